"""Evaluation means over the dataset's rows in the default mode (issue 49): no padding row weighs in.

Lightning's ``DistributedSampler`` pads a rank's shard with rows from the start, inside its last batch,
and so does a padded ``SequentialDistributedSampler``: a validation loss logged with ``sync_dist`` over
301 rows in batches of 40 on 2 ranks was the mean over 302 (a1c30de: 2.09563 against 2.09741), and a
torchmetrics accuracy counted the padding row too. The strategy now gives each rank whole batches with
its padding in batches of their own, which count for nothing, and every rank runs the same number of
batches: a value logged with ``sync_dist`` on every step (a collective per batch) does not hang. Models:
an MLP, and token ids through an embedding and a LayerNorm (no BatchNorm anywhere).
"""

import os

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from ddp_plugins.lightning.sequential_evaluation import SequentialEvaluation
from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from ddp_plugins.testing import run_lightning

ROWS, BATCH = 301, 40


def _data(kind="mlp"):
    g = torch.Generator().manual_seed(5)
    if kind == "embedding-layernorm":  # rows of 5 token ids
        x = torch.randint(0, 20, (ROWS, 5), generator=g)
        return TensorDataset(x, (x[:, 0] > 10).long() + (x[:, 1] > 5).long())
    x = torch.randn(ROWS, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.3).long())


def _net(kind="mlp"):
    torch.manual_seed(0)
    if kind == "embedding-layernorm":  # no BatchNorm: each row's output is its own, whatever the batch
        return nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.Flatten(), nn.Linear(40, 3))
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


class _Model(pl.LightningModule):
    def __init__(self, kind="mlp"):
        super().__init__()
        self.net = _net(kind)
        self.acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.batches = 0

    def _evaluate(self, batch, stage):
        x, y = batch
        logits = self.net(x)
        self.batches += 1
        self.log(f"{stage}/loss", cross_entropy(logits, y), sync_dist=True)
        self.log(f"{stage}/step_rows", float(len(y)), sync_dist=True, on_step=True, on_epoch=False)  # every batch
        self.acc(logits, y)
        self.log(f"{stage}/acc", self.acc)
        return {"preds": logits, "target": y}

    def validation_step(self, batch, batch_idx):
        return self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        return self._evaluate(batch, "test")


def _evaluate(out_dir, sequential, kind="mlp"):
    callbacks = [SequentialEvaluation()] if sequential else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE_HINT"]), strategy=DDPPluginsStrategy(backend="gloo"),
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = _Model(kind)
    loader = DataLoader(_data(kind), batch_size=BATCH)
    (validated,) = trainer.validate(model, loader, verbose=False)
    model.batches, first = 0, model.batches
    (tested,) = trainer.test(model, loader, verbose=False)
    return {"val": validated, "test": tested, "batches": (first, model.batches)}


def _one_process(kind="mlp"):
    x, y = _data(kind).tensors
    logits = _net(kind)(x).detach()
    return float(cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


@pytest.mark.slow
@pytest.mark.parametrize("sequential", [False, True], ids=["lightnings-sampler", "sequential-evaluation"])
@pytest.mark.parametrize(
    ("world_size", "kind"), [(2, "mlp"), (3, "mlp"), (3, "embedding-layernorm")], ids=["2-mlp", "3-mlp", "3-embedding"]
)
def test_sync_dist_means_and_metrics_are_over_the_datasets_rows(world_size, kind, sequential):
    loss, accuracy = _one_process(kind)
    ranks = run_lightning(_evaluate, sequential, kind, world_size=world_size, timeout=180)
    batches = {rank["batches"] for rank in ranks}
    assert len(batches) == 1, f"the ranks ran different numbers of batches: {[r['batches'] for r in ranks]}"
    for stage in ("val", "test"):
        logged = ranks[0][stage]
        assert logged[f"{stage}/loss"] == pytest.approx(loss, rel=1e-6, abs=0), f"{stage}: a padding row weighed in"
        assert logged[f"{stage}/acc"] == pytest.approx(accuracy, rel=1e-6, abs=0), f"{stage}: a padding row counted"
