"""A stop at an epoch's last step, with epoch metrics a progress bar reads on rank 0 only (issue 50).

Lightning's progress bar runs on rank 0 only, and its ``on_train_epoch_end`` reads the epoch's
metrics: a torchmetrics object's ``compute`` gathers, a ``sync_dist`` value is reduced there, on
rank 0 alone; the other ranks compute them after every callback's ``on_train_epoch_end``. The
checkpoint of the epoch's last step is written in ``PreemptionCheckpoint.on_train_epoch_end`` and
gathers every rank's state: with the bar listed first, rank 0 waited in the metrics' gather and
rank 1 in the checkpoint's, until gloo timed out (exit 1, no checkpoint). Here both orders stop
with the step checkpoint and exit 143 and resume bit-identically; a step checkpoint due at the
epoch's last step, with no signal, is written too.
"""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ddp_plugins.core import Preempted
from ddp_plugins.lightning import DDPPluginsStrategy, PreemptionCheckpoint
from ddp_plugins.testing import run_lightning
from tests.helpers.interrupt import SignalAt

_BATCHES = 4  # per rank and epoch: 32 rows, 2 ranks, batches of 4


class _Classifier(pl.LightningModule):
    """Logs as lightning-hydra-template's module does: torchmetrics objects and a ``sync_dist``
    loss, epoch-level and on the progress bar."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 3)
        self.acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.mean_loss = MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.acc(logits, y)
        self.mean_loss(loss)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("train/acc", self.acc, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/mean_loss", self.mean_loss, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=4)


def _fit(folder, bar_first, every_n_train_steps=0, signal_at=None, ckpt_path=None):
    os.makedirs(folder, exist_ok=True)  # SignalAt's marker file is written there
    bar = TQDMProgressBar(refresh_rate=1)
    preemption = PreemptionCheckpoint(every_n_train_steps=every_n_train_steps, check_every_n_steps=1)
    callbacks = [bar, preemption] if bar_first else [preemption, bar]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPPluginsStrategy(backend="gloo", timeout=30), max_epochs=2,
        default_root_dir=folder, callbacks=[*callbacks, *([signal_at] if signal_at else [])], logger=False,
        enable_progress_bar=True, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
    )  # fmt: skip
    model = _Classifier()
    trainer.fit(model, ckpt_path=ckpt_path)
    assert trainer.num_training_batches == _BATCHES, trainer.num_training_batches
    return [p.detach().clone() for p in model.parameters()]


def _stop_at_the_epochs_last_step(out_dir, bar_first, how):
    """The uninterrupted run's parameters, the stop (or step checkpoint) at step 4 of 8, and the
    parameters after resuming from that checkpoint."""
    reference = _fit(os.path.join(out_dir, "reference"), bar_first)
    folder = os.path.join(out_dir, "run")
    stop = None
    if how == "signal":  # SIGTERM to rank 0 as the epoch's last batch starts (global step 3, batch 3 of 0..3)
        try:
            _fit(folder, bar_first, signal_at=SignalAt("train_batch_start", step=_BATCHES - 1, rank=0))
        except Preempted as error:
            stop = {"code": error.code, "checkpoint": os.path.basename(error.checkpoint)}
        ckpt = os.path.join(folder, "checkpoints", f"step-{_BATCHES}-preempted.ckpt")
    else:  # no signal: a step checkpoint due at the epoch's last step
        _fit(folder, bar_first, every_n_train_steps=_BATCHES)
        ckpt = os.path.join(folder, "checkpoints", f"step-{_BATCHES}.ckpt")
    names = sorted(name for name in os.listdir(os.path.join(folder, "checkpoints")) if name.endswith(".ckpt"))
    resumed = _fit(os.path.join(out_dir, "resumed"), bar_first, ckpt_path=ckpt)
    return {"stop": stop, "names": names, "reference": reference, "resumed": resumed}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("bar_first", [True, False], ids=["bar-first", "bar-last"])
@pytest.mark.parametrize("how", ["signal", "every-n-steps"])
def test_a_stop_at_the_epochs_last_step_checkpoints_and_resumes_bit_identically(bar_first, how):
    for rank, result in enumerate(run_lightning(_stop_at_the_epochs_last_step, bar_first, how, timeout=180)):
        if how == "signal":
            expected = {"code": 128 + signal.SIGTERM, "checkpoint": f"step-{_BATCHES}-preempted.ckpt"}
            assert result["stop"] == expected, f"rank {rank} should stop at step {_BATCHES}: {result['stop']}"
            assert f"step-{_BATCHES}-preempted.ckpt" in result["names"], result["names"]
        else:
            assert result["names"] == [f"step-{_BATCHES}.ckpt", f"step-{2 * _BATCHES}.ckpt"], result["names"]
        for got, expected in zip(result["resumed"], result["reference"], strict=True):
            assert torch.equal(got, expected), f"rank {rank}: resumed parameters differ from the uninterrupted run's"
