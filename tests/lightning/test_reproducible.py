"""The reproducible mode: the same bits on 1, 2, 3, 4 and 8 ranks (8 is the default virtual_shards).

A CNN with BatchNorm (the SyncBN callback on: it steps aside) and dropout, trained 2 epochs with
SGD (momentum) and with Adam in float32, on 150 rows: G=64 leaves a short last step of 22 rows
and G=32 one of 22 too, over 8 virtual shards. Every parameter, buffer and optimizer-state
tensor, the fingerprints and the logged epoch metrics (train loss, the validation loss and the
exact accuracy of SequentialEvaluation) must be bitwise equal to the one-rank run's. The default
mode on the same runs is not (it is checked to differ, so the comparison can fail).
"""

import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from ddp_plugins.core.reproducible import ShardedStep, exact_sum, fingerprint
from ddp_plugins.lightning.reproducible import FINGERPRINT_KEY
from ddp_plugins.lightning.sequential_evaluation import SequentialEvaluation
from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from ddp_plugins.lightning.sync_batchnorm import SyncBatchNormCallback
from ddp_plugins.testing import run_lightning

ROWS, VAL_ROWS, SEED = 150, 45, 3


def _data(rows, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, 6, 6, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 0.5).long()
    return TensorDataset(x, y)


class _Net(pl.LightningModule):
    def __init__(self, optimizer):
        super().__init__()
        torch.manual_seed(0)
        self.optimizer = optimizer
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Dropout(0.3),
            nn.Linear(144, 3),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = cross_entropy(self.net(x), y)
        self.log("train/loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val/loss", cross_entropy(logits, y), sync_dist=True)
        return {"preds": logits, "target": y}

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(_data(ROWS, 1), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(VAL_ROWS, 2), batch_size=8)


def _fit(optimizer, global_batch_size, reproducible, ckpt_dir=None):
    pl.seed_everything(SEED)
    model = _Net(optimizer)
    epochs = {}

    class Record(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            epochs[trainer.current_epoch] = {k: v.clone() for k, v in trainer.callback_metrics.items()}

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE_HINT"]),
        strategy=DDPPluginsStrategy(backend="gloo", global_batch_size=global_batch_size, reproducible=reproducible),
        callbacks=[
            SyncBatchNormCallback(),
            SequentialEvaluation(metrics={"acc": MulticlassAccuracy(num_classes=3, average="micro")}),
            Record(),
        ],
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as seen:  # Lightning's hint to sync what is already exact
        warnings.simplefilter("always")
        trainer.fit(model)
    hints = [str(w.message) for w in seen if "sync_dist=True" in str(w.message)]
    checkpoint = None
    if ckpt_dir is not None:
        path = os.path.join(ckpt_dir, f"end-{trainer.world_size}.ckpt")
        trainer.save_checkpoint(path)
        checkpoint = torch.load(path, weights_only=True)[FINGERPRINT_KEY]
    optimizer_state = trainer.optimizers[0].state_dict()
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer_state,
        "fingerprint": fingerprint(model.state_dict(), [optimizer_state]),
        "checkpoint_fingerprint": checkpoint,
        "metrics": epochs,
        "sync_dist_hints": hints,
    }


def _runs(out_dir, reproducible=True):
    return {
        ("sgd", 64): _fit("sgd", 64, reproducible, ckpt_dir=out_dir),
        ("adam", 32): _fit("adam", 32, reproducible),
    }


def _tensors(value, prefix=""):
    """Every tensor of a nested result, by path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _tensors(item, f"{prefix}/{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _tensors(item, f"{prefix}/{i}").items()}
    return {}


@pytest.fixture(scope="module")
def one_rank():
    return run_lightning(_runs, world_size=1, timeout=240)[0]


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_the_same_bits_on_any_number_of_ranks(one_rank, world_size):
    ranks = run_lightning(_runs, world_size=world_size, timeout=300)
    for run, reference in one_rank.items():
        expected = _tensors(reference)
        assert len(expected) > 20  # parameters, buffers, optimizer state, two epochs of metrics
        assert {"/metrics/1/val/loss", "/metrics/1/val/acc", "/metrics/1/train/loss"} <= set(expected)
        for rank, result in enumerate(ranks):
            got = _tensors(result[run])
            assert got.keys() == expected.keys(), run
            differ = [k for k in expected if not torch.equal(got[k], expected[k])]
            assert not differ, f"{run} on {world_size} ranks, rank {rank}: {differ[:5]} differ"
            assert result[run]["fingerprint"] == reference["fingerprint"]
            assert result[run]["sync_dist_hints"] == [], result[run]["sync_dist_hints"]  # train/ and val/loss
        if reference["checkpoint_fingerprint"] is not None:
            assert ranks[0][run]["checkpoint_fingerprint"] == reference["checkpoint_fingerprint"]


def _default_mode(out_dir):
    return _runs(out_dir, reproducible=False)


def test_the_default_mode_differs_in_the_last_bits(one_rank):
    """What the mode fixes: without it the same plan on 2 ranks ends close to, not equal to, one rank."""
    one = run_lightning(_default_mode, world_size=1, timeout=240)[0]
    two = run_lightning(_default_mode, world_size=2, timeout=240)[0]
    assert one[("adam", 32)]["fingerprint"] != two[("adam", 32)]["fingerprint"]


def test_exact_sum_is_the_same_in_any_grouping():
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(100, generator=g) * 10 ** float(torch.randint(-6, 6, (1,), generator=g)) for _ in range(8)]
    weights = [3.0, 5, 1, 8, 8, 2, 7, 4]
    whole = exact_sum([[v] for v in values], like=[values[0]], weights=weights)[0][0]
    reordered = exact_sum([[v] for v in values[::-1]], like=[values[0]], weights=weights[::-1])[0][0]
    # grouped as 3 ranks would: partial integer sums are added, never rounded
    assert torch.equal(whole, reordered)
    reference = sum(w * v.double() for w, v in zip(weights, values, strict=True))
    assert torch.allclose(whole.double(), reference, rtol=1e-6, atol=1e-6 * float(reference.abs().max()))
    naive_forward = sum(w * v for w, v in zip(weights, values, strict=True))
    naive_backward = sum(w * v for w, v in zip(weights[::-1], values[::-1], strict=True))
    assert not torch.equal(naive_forward, naive_backward)  # what float sums do


def test_a_non_finite_value_makes_the_sum_nan_and_leaves_the_other_tensors_exact():
    empty = torch.zeros(0)  # a tensor of no values beside the non-finite one (a layer of 0 features)
    shards = [[torch.tensor([1.0, 2.0]), empty, torch.tensor([0.5])], [torch.tensor([float("inf"), 1.0]), empty, None]]
    out = exact_sum(shards, like=[torch.zeros(2), empty, torch.zeros(1)])[0]
    assert torch.isnan(out[0]).all()
    assert out[1].numel() == 0 and torch.equal(out[2], torch.tensor([0.5], dtype=out[2].dtype))


def test_sharded_step_equals_one_process_on_the_step():
    """Two shards of a model without BatchNorm give one process's gradient on the whole step (to rounding)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    x, y = torch.randn(10, 5), torch.randn(10, 2)
    cross = (model(x) - y).pow(2).mean()
    cross.backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    step = ShardedStep(model, virtual_shards=2)
    for shard, (a, b) in enumerate([(0, 6), (6, 10)]):
        with step.shard(shard, rows=b - a, epoch=0, step=0):
            (model(x[a:b]) - y[a:b]).pow(2).mean().backward()
    step.finish(step_rows=10)
    step.apply()
    for p, expected in zip(model.parameters(), whole, strict=True):
        torch.testing.assert_close(p.grad, expected)


class _Watched(_Net):
    """Records whether ``self.log`` is still the class's method, and the Trainer's callbacks, in each step."""

    def __init__(self):
        super().__init__("sgd")
        self.replaced, self.callbacks_seen = [], []

    def _watch(self):
        self.replaced.append("log" in vars(self))
        self.callbacks_seen.append(list(self.trainer.callbacks))

    def training_step(self, batch, batch_idx):
        self._watch()
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self._watch()
        return super().validation_step(batch, batch_idx)


@pytest.mark.usefixtures("clean_process_state")
def test_the_mode_leaves_module_log_and_the_callbacks_alone():
    model = _Watched()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1,
        strategy=DDPPluginsStrategy(backend="gloo", global_batch_size=64, reproducible=True),
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    before = list(trainer.callbacks)
    trainer.fit(model)
    assert len(model.replaced) == 3 * 8 + 6, "8 shards in each of 3 steps, 6 validation batches"
    assert not any(model.replaced) and "log" not in vars(model), "module.log was replaced on the instance"
    assert all(seen == before for seen in model.callbacks_seen) and trainer.callbacks == before
    x, y = _data(VAL_ROWS, 2).tensors
    with torch.no_grad():
        expected = cross_entropy(model.eval().net(x), y)  # the mean over every validation row
    torch.testing.assert_close(float(trainer.callback_metrics["val/loss"]), float(expected), rtol=1e-6, atol=0)
