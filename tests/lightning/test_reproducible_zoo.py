"""The reproducible mode on models that are not the demo CNN: the same bits on 1 to 8 ranks (issue 43).

A zoo of small models unlike ours, each trained 2 epochs on 1, 2, 3, 4, 5, 6, 7 and 8 ranks of
``DDPPluginsStrategy(global_batch_size=16, reproducible=True)`` (V = 8 virtual shards; 60 rows:
a short last step of 12 rows), in float32, in ``64-true``, where any difference of the rounding
grid between world sizes shows in the last bits, and in ``bf16-mixed`` (CPU autocast):

- an MLP over an ``nn.Embedding`` with LayerNorm, GELU and Dropout, trained by AdamW with weight
  decay, a per-step OneCycleLR and gradient clipping;
- a CNN with BatchNorm and Dropout (SGD with momentum);
- a small ``nn.TransformerEncoder`` (dropout on, AdamW).

Every parameter, buffer, optimizer and scheduler state tensor, every logged epoch value and the
fingerprint must be ``torch.equal`` to the one-rank run's; the logged validation loss is the mean
over the validation set's rows (a plain ``DataLoader``: no sampler of ours, a short last batch).
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugins.core.reproducible import fingerprint
from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from ddp_plugins.testing import run_lightning

ROWS, VAL_ROWS, G, EPOCHS, TOKENS = 60, 20, 16, 2, 50


def _data(kind: str, rows: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    if kind == "cnn":
        x = torch.randn(rows, 1, 6, 6, generator=g)
        return TensorDataset(x, (x.mean(dim=(1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 0.5).long())
    x = torch.randint(0, TOKENS, (rows, 6), generator=g)
    return TensorDataset(x, (x[:, 0] % 3))


class _Zoo(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        if kind == "mlp":
            self.net = nn.Sequential(
                nn.Embedding(TOKENS, 8), nn.Flatten(), nn.LayerNorm(48), nn.Linear(48, 32), nn.GELU(),
                nn.Dropout(0.2), nn.Linear(32, 3),
            )  # fmt: skip
        elif kind == "cnn":
            self.net = nn.Sequential(
                nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Dropout(0.3),
                nn.Linear(144, 3),
            )  # fmt: skip
        else:
            layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
            self.net = nn.Sequential(
                nn.Embedding(TOKENS, 16), nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False),
                nn.Flatten(), nn.Linear(96, 3),
            )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = cross_entropy(self.net(x), y)
        self.log("train/loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.kind == "cnn":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.05)
        if self.kind == "transformer":
            return optimizer
        steps = EPOCHS * -(-ROWS // G)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.02, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(_data(self.kind, ROWS, 1), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(self.kind, VAL_ROWS, 2), batch_size=8)


def _fit(kind: str, precision: str) -> dict:
    pl.seed_everything(3)
    model = _Zoo(kind)
    epochs = {}

    class Record(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            epochs[trainer.current_epoch] = {k: v.clone() for k, v in trainer.callback_metrics.items()}

    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE_HINT"]), precision=precision,
        strategy=DDPPluginsStrategy(backend="gloo", global_batch_size=G, reproducible=True),
        callbacks=[Record()], max_epochs=EPOCHS, gradient_clip_val=0.5 if kind == "mlp" else None,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model)
    model.eval()  # the last validation saw the final weights: its mean is the mean over the dataset's rows
    with torch.no_grad():
        x, y = _data(kind, VAL_ROWS, 2).tensors
        x = x.to(next(model.parameters()).dtype) if x.is_floating_point() else x
        direct = cross_entropy(model.net(x).double(), y, reduction="none").mean()
    optimizer = trainer.optimizers[0].state_dict()
    schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer,
        "schedulers": schedulers,
        "fingerprint": fingerprint(model.state_dict(), [optimizer]),
        "metrics": epochs,
        "val_direct": direct,
    }


RUNS = [
    ("mlp", "32-true"), ("cnn", "32-true"), ("transformer", "32-true"), ("mlp", "64-true"), ("cnn", "64-true"),
    ("mlp", "bf16-mixed"), ("transformer", "bf16-mixed"),  # CPU autocast in bfloat16 inside each shard
]  # fmt: skip


def _zoo(out_dir):
    return {run: _fit(*run) for run in RUNS}


def _tensors(value, prefix=""):
    """Every tensor (and scheduler number) of a nested result, by path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, float):
        return {prefix: torch.tensor(value, dtype=torch.float64)}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _tensors(item, f"{prefix}/{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _tensors(item, f"{prefix}/{i}").items()}
    return {}


@pytest.mark.slow
@pytest.mark.e2e  # 140 s here: make test-e2e; make test proves the bits on 1 to 4 ranks in the promise matrix
@pytest.mark.timeout(900)
def test_a_zoo_of_models_gives_the_same_bits_on_1_to_8_ranks():
    reference = run_lightning(_zoo, world_size=1, timeout=300)[0]
    for run, result in reference.items():
        expected = _tensors(result)
        assert {"/metrics/1/val/loss", "/metrics/1/train/loss"} <= set(expected), run
        logged, direct = result["metrics"][1]["val/loss"], result["val_direct"]
        # 20 rows in batches of 8: a short last batch, never padded (a padded one was 1% off); in
        # bfloat16 the batches' own losses are rounded to 8 bits
        tolerance = 2e-2 if run[1] == "bf16-mixed" else 2e-6
        assert abs(float(logged) - float(direct)) <= tolerance * float(direct), (run, float(logged), float(direct))
        assert result["state"]["net.1.weight" if run[0] == "cnn" else "net.0.weight"].dtype == (
            torch.float64 if run[1] == "64-true" else torch.float32
        )
    for world_size in range(2, 9):
        ranks = run_lightning(_zoo, world_size=world_size, timeout=300)
        for run, result in reference.items():
            expected = _tensors(result)
            for rank, got in enumerate(ranks):
                found = _tensors(got[run])
                assert found.keys() == expected.keys(), (run, world_size)
                differ = [k for k in expected if not torch.equal(found[k], expected[k])]
                assert not differ, f"{run} on {world_size} ranks, rank {rank}: {differ[:5]} differ"
                assert got[run]["fingerprint"] == result["fingerprint"], (run, world_size, rank)
