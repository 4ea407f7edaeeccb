"""The reproducible mode while layers are frozen and unfrozen during fit (issue 51).

An MLP whose first Linear is frozen in ``on_fit_start`` and unfrozen after global step 5 (as
``BackboneFinetuning`` does), and whose last Linear is frozen after step 9, trained in float64
(``64-true``) with SGD and momentum: on 1, 2 and 3 ranks every parameter and optimizer-state
tensor is the same bits, the unfrozen layer trained from step 5 on, the frozen one kept its
step-9 weights, and the run ends where the default mode on one rank ends (the same steps, its
float sums: within 1e-10). At a1c30de the unfrozen layer never trained, with no word.
A rank that freezes alone is refused on every rank in one line, not left to hang.
"""

from __future__ import annotations

import logging
import os

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugins.core.reproducible import ShardedStep, fingerprint
from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from ddp_plugins.testing import run_lightning

ROWS, G, V, UNFREEZE_AT, FREEZE_AT = 72, 12, 6, 5, 9  # 6 steps of 12 rows per epoch, 2 epochs


class _MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = cross_entropy(self.net(x), y)
        self.log("train/loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(ROWS, 6, generator=g, dtype=torch.float64)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()), batch_size=4, shuffle=True)


class _Finetuning(pl.Callback):
    """Freezes ``net.0`` at the start and unfreezes it after step ``UNFREEZE_AT``; freezes ``net.4`` after
    ``FREEZE_AT``: between steps, the same on every rank (``only_rank``: only on that rank)."""

    def __init__(self, only_rank: int | None = None) -> None:
        self.only_rank, self.seen = only_rank, {}

    def on_fit_start(self, trainer, pl_module):
        pl_module.net[0].requires_grad_(False)
        self.seen["first_at_start"] = pl_module.net[0].weight.detach().clone()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.only_rank is not None and trainer.global_rank != self.only_rank:
            return
        if trainer.global_step == UNFREEZE_AT and not pl_module.net[0].weight.requires_grad:
            self.seen["first_at_unfreeze"] = pl_module.net[0].weight.detach().clone()
            pl_module.net[0].requires_grad_(True)
        if trainer.global_step == FREEZE_AT and pl_module.net[4].weight.requires_grad:
            pl_module.net[4].requires_grad_(False)
            self.seen["last_at_freeze"] = pl_module.net[4].weight.detach().clone()


def _fit(out_dir, reproducible=True, only_rank=None):
    pl.seed_everything(3)
    model, callback = _MLP(), _Finetuning(only_rank)
    options = {} if reproducible else {"find_unused_parameters": True}  # the default mode's DDP needs it
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE_HINT"]), precision="64-true",
        strategy=DDPPluginsStrategy(backend="gloo", global_batch_size=G, reproducible=reproducible,
                                    virtual_shards=V, **options),
        callbacks=[callback], max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model)
    optimizer = trainer.optimizers[0].state_dict()
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "momentum": {k: v["momentum_buffer"].clone() for k, v in optimizer["state"].items() if v},
        "fingerprint": fingerprint(model.state_dict(), [optimizer]),
        "seen": callback.seen,
        "steps": trainer.global_step,
    }


def _default_mode(out_dir):
    return _fit(out_dir, reproducible=False)


def _freezing_on_rank_one_only(out_dir):
    return _fit(out_dir, only_rank=1)


@pytest.fixture(scope="module")
def one_rank():
    return run_lightning(_fit, world_size=1, timeout=180)[0]


def test_an_unfrozen_layer_trains_from_that_step_and_a_frozen_one_stops(one_rank):
    state, seen = one_rank["state"], one_rank["seen"]
    assert one_rank["steps"] == 12
    assert torch.equal(seen["first_at_unfreeze"], seen["first_at_start"]), "trained while frozen"
    assert not torch.equal(state["net.0.weight"], seen["first_at_start"]), "the unfrozen layer never trained"
    assert torch.equal(state["net.4.weight"], seen["last_at_freeze"]), "the frozen layer went on training"
    assert len(one_rank["momentum"]) == 6, "every parameter has momentum: net.0's since its unfreezing"


def test_the_same_as_the_default_mode_on_one_rank(one_rank):
    """The mode's exact sums against DDP's float sums of the same steps: the same training, to float64 noise."""
    default = run_lightning(_default_mode, world_size=1, timeout=180)[0]
    torch.testing.assert_close(one_rank["state"], default["state"], rtol=0, atol=1e-10)
    torch.testing.assert_close(one_rank["momentum"], default["momentum"], rtol=0, atol=1e-10)


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_same_bits_on_two_and_three_ranks(one_rank, world_size):
    for rank, result in enumerate(run_lightning(_fit, world_size=world_size, timeout=240)):
        differ = [k for k, v in one_rank["state"].items() if not torch.equal(result["state"][k], v)]
        differ += [
            f"momentum {k}" for k, v in one_rank["momentum"].items() if not torch.equal(result["momentum"][k], v)
        ]
        assert not differ, f"{world_size} ranks, rank {rank}: {differ} differ from one rank"
        assert result["fingerprint"] == one_rank["fingerprint"]


def test_a_rank_that_unfreezes_alone_is_refused_on_every_rank_in_one_line():
    with pytest.raises(AssertionError) as failed:
        run_lightning(_freezing_on_rank_one_only, world_size=2, timeout=120)
    said = str(failed.value)
    assert "the ranks train different parameters in this step" in said, said[-3000:]
    assert "Freeze and unfreeze alike on every rank" in said, said[-3000:]


def test_a_change_inside_a_step_is_refused_and_a_change_between_steps_is_said(caplog):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    step = ShardedStep(model, virtual_shards=2)
    with step.shard(0, rows=2, epoch=0, step=0):
        model(torch.randn(2, 3)).sum().backward()
        model[0].requires_grad_(False)
    with pytest.raises(ValueError) as refused:
        step.finish(step_rows=2)
    message = str(refused.value)
    assert "\n" not in message and "requires_grad of 0.weight, 0.bias changed inside a training step" in message
    step = ShardedStep(model, virtual_shards=2)
    with step.shard(0, rows=2, epoch=0, step=0):
        model(torch.randn(2, 3)).sum().backward()
    step.finish(step_rows=2)
    assert step.changed is None and [g is None for g in step.grads] == [True, True, False, False]
    model[0].requires_grad_(True)
    x = torch.randn(4, 3)
    for shard in (0, 1):
        with step.shard(shard, rows=2, epoch=0, step=1):
            model(x[2 * shard : 2 * shard + 2]).pow(2).mean().backward()
    step.finish(step_rows=4)
    step.apply()
    assert step.changed == (["0.weight", "0.bias"], [])
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (model(x[:2]).pow(2).mean() + model(x[2:]).pow(2).mean()).div(2).backward()
    for p, grad in zip(model.parameters(), got, strict=True):
        torch.testing.assert_close(grad, p.grad)


@pytest.mark.usefixtures("clean_process_state")
def test_the_log_says_from_which_step_a_layer_trains(caplog):
    model = _MLP()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision="64-true", max_epochs=2, callbacks=[_Finetuning()],
        strategy=DDPPluginsStrategy(global_batch_size=G, reproducible=True, virtual_shards=V),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        trainer.fit(model)
    said = [r.getMessage() for r in caplog.records if "reproducible mode: from step" in r.getMessage()]
    assert said == [
        "ddp_plugins: reproducible mode: from step 5 on, the model trains net.0.weight, net.0.bias.",
        "ddp_plugins: reproducible mode: from step 9 on, the model no longer trains net.4.weight, net.4.bias.",
    ], said
