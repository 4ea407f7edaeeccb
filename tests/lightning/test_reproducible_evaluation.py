"""The reproducible mode's evaluation: every rank runs as many batches, the same batches on any N (issue 51).

Aligned shards gave 20 validation rows in batches of 8 as 2 batches on rank 0 and 1 on rank 1, so a
collective in the user's ``validation_step`` (``self.all_gather`` here) waited forever on rank 0. Now
every rank runs the dataset's batches in order, a rank past the rows a padding batch that counts for
nothing, and the logged means equal one process's bit for bit, with and without SequentialEvaluation.
"""

from __future__ import annotations

import math
import os

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy

from ddp_plugins.lightning.sequential_evaluation import SequentialEvaluation
from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from ddp_plugins.testing import run_lightning
from tests.helpers.models import three_classes

pytestmark = pytest.mark.usefixtures("clean_process_state")

TRAIN_ROWS, VAL_ROWS, VAL_BATCH = 24, 20, 8  # 3 validation batches: 2 + 1 on 2 ranks, 1 + 1 + 1 + none on 4


class _Gathering(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        self.batches = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.all_gather(logits.sum())  # a collective every rank must meet, at every batch
        self.batches += 1
        self.log("val/loss", cross_entropy(logits, y), sync_dist=True)
        return {"preds": logits, "target": y}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(three_classes(TRAIN_ROWS, 1), batch_size=4)

    def val_dataloader(self):
        return DataLoader(three_classes(VAL_ROWS, 2), batch_size=VAL_BATCH)


def _fit(out_dir, sequential):
    model = _Gathering()
    callbacks = [SequentialEvaluation(metrics={"acc": MulticlassAccuracy(num_classes=3, average="micro")})]
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE_HINT"]),
        strategy=DDPPluginsStrategy(backend="gloo", global_batch_size=8, reproducible=True),
        callbacks=callbacks if sequential else [], max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model)
    return {"batches": model.batches, "logged": {k: v.clone() for k, v in trainer.callback_metrics.items()}}


@pytest.fixture(scope="module")
def one_rank():
    return {sequential: run_lightning(_fit, sequential, world_size=1, timeout=120)[0] for sequential in (False, True)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "sequential"),
    [
        (2, False),  # the case: 2 batches on rank 0, 1 on rank 1
        (4, True),  # rank 3 holds no row: a padding batch only
        pytest.param(2, True, marks=pytest.mark.e2e),
        pytest.param(4, False, marks=pytest.mark.e2e),
    ],
    ids=["2-strategy", "4-SequentialEvaluation", "2-SequentialEvaluation", "4-strategy"],
)
def test_every_rank_runs_as_many_batches_and_the_means_are_one_process(one_rank, world_size, sequential):
    ranks = run_lightning(_fit, sequential, world_size=world_size, timeout=120)
    batches = [rank["batches"] for rank in ranks]
    assert batches == [math.ceil(math.ceil(VAL_ROWS / VAL_BATCH) / world_size)] * world_size, batches
    reference = one_rank[sequential]["logged"]
    names = {"val/loss", "val/acc"} if sequential else {"val/loss"}
    assert names <= reference.keys()
    for rank in ranks:
        for name in names:
            got, want = rank["logged"][name], reference[name]
            assert torch.equal(got, want), f"{name} on {world_size} ranks: {float(got)}, one process: {float(want)}"
