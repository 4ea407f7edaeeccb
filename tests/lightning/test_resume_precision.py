"""A ``64-true`` fit resumed by a new Trainer goes on from the checkpoint's float64 parameters, every bit.

Lightning restores a checkpoint before its strategy's ``setup`` converts the module to float64: the saved
values went through the new module's float32 parameters and lost their low bits (about 1e-8 relative),
so the resumed run was not the uninterrupted one. ``DDPPluginsStrategy`` converts the module first. Found
by the promise matrix's ``resume-n`` flow (a new process resumes); Lightning's own ``ddp`` is the control.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from ddp_plugins.testing import run_lightning


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.restored: dict[str, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(1))), batch_size=4)

    def on_train_start(self):  # the parameters the resumed fit starts from
        self.restored = {name: p.detach().clone() for name, p in self.net.named_parameters()}


def _resumed(out_dir: str, strategy: str) -> dict:
    """Fit one epoch, then a new Trainer and a new module resume from its checkpoint: what was saved, and
    what the resumed fit started from."""

    def trainer(epochs: int) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu", devices=1, strategy=DDPPluginsStrategy() if strategy == "ours" else "ddp",
            precision="64-true", max_epochs=epochs, default_root_dir=out_dir, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip

    first = trainer(1)
    first.fit(_Regression())
    path = os.path.join(out_dir, f"{strategy}.ckpt")
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["state_dict"]
    module = _Regression()
    trainer(2).fit(module, ckpt_path=path)
    return {"saved": {k[len("net.") :]: v for k, v in saved.items()}, "restored": module.restored}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ours", "lightning"])
def test_a_64_true_checkpoint_resumes_with_every_bit(strategy):
    (result,) = run_lightning(_resumed, strategy, world_size=1, timeout=120)
    saved, restored = result["saved"], result["restored"]
    assert all(value.dtype == torch.float64 for value in saved.values()), "a 64-true checkpoint holds float64"
    same = all(torch.equal(restored[name], value) for name, value in saved.items())
    if strategy == "ours":
        assert same, {name: float((restored[name] - value).abs().max()) for name, value in saved.items()}
    else:  # the control: Lightning's own strategy, as a1c30de's and Lightning's resume lost the low bits
        assert not same, "Lightning's ddp now restores every bit: the conversion of ours may go"
