"""A user's own training loaders resume bit for bit (issue 44).

A LightningModule with BatchNorm and Dropout trains on loaders a user writes: ``shuffle=True``
with no ``generator`` and 2 workers (persistent or not; per-rank batches or a global plan), and a
sampler of the user's own that shuffles with torch's global generator (split by Lightning's
``DistributedSampler``, or one per rank). Each run is stopped by a real SIGTERM in the middle of an
epoch (``PreemptionCheckpoint``, ``RankAwareSeed``) and resumed on the same 2 ranks from the checkpoint.
Every parameter, buffer and optimizer-state tensor, the loss of every resumed step, the rows each
step trained and the global random state each step began with must be bitwise equal to the
uninterrupted run's, and the resume names nothing as inexact.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Sampler

from ddp_plugins.core import Preempted
from ddp_plugins.lightning import DDPPluginsStrategy, PreemptionCheckpoint, RankAwareSeed
from ddp_plugins.testing import run_lightning

ROWS, BATCH, EPOCHS, STOP_AT, SEED = 96, 4, 2, 17, 7  # 12 steps per epoch on 2 ranks (24 unsplit)


class _Rows(Dataset):
    """Fixed rows, each with its index (so a test sees which rows every step trained)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(ROWS, 6, generator=generator)
        self.y = (self.x[:, 0] + self.x[:, 1] > 0).long() + (self.x[:, 2] > 0.5).long()

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class _OwnShuffle(Sampler):
    """A user's shuffling sampler: a new order each epoch from torch's global generator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())

    def __len__(self) -> int:
        return self.n


class _Net(pl.LightningModule):
    def __init__(self, loader: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.loader = loader
        self.net = nn.Sequential(
            nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3)
        )  # fmt: skip
        self.steps: dict[int, tuple] = {}

    def training_step(self, batch, batch_idx):
        x, y, rows = batch
        state = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.steps[self.global_step] = (loss.detach().clone(), rows.tolist(), state)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = _Rows()
        if self.loader == "own_sampler":
            return DataLoader(data, batch_size=BATCH, sampler=_OwnShuffle(ROWS), num_workers=2)
        persistent = self.loader == "shuffle_persistent"
        return DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=persistent)


class _SigtermAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(folder: str, loader: str, setting: dict, stop_at: int | None = None, ckpt_path: str | None = None) -> _Net:
    model = _Net(loader)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPPluginsStrategy(backend="gloo", **setting.get("strategy", {})),
        max_epochs=EPOCHS, default_root_dir=folder, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **setting.get("trainer", {}),
        callbacks=[RankAwareSeed(SEED), PreemptionCheckpoint(check_every_n_steps=1),
                   *([_SigtermAt(stop_at)] if stop_at is not None else [])],
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def _state(model: _Net) -> dict[str, torch.Tensor]:
    tensors = {f"module.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = model.trainer.optimizers[0].state_dict()["state"]
    for index, values in optimizer.items():
        tensors.update({f"adam.{index}.{k}": v.clone() for k, v in values.items()})
    return tensors


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _stop_and_resume(out_dir: str, loader: str, setting: dict) -> dict:
    reference = _fit(os.path.join(out_dir, "reference"), loader, setting)
    folder = os.path.join(out_dir, "resumed")
    try:
        _fit(folder, loader, setting, stop_at=STOP_AT)
        raise AssertionError(f"the run was not stopped at step {STOP_AT}")
    except Preempted as stop:
        checkpoint = stop.checkpoint
    messages = _Messages()
    logging.getLogger("ddp_plugins").addHandler(messages)
    try:
        resumed = _fit(folder, loader, setting, ckpt_path=checkpoint)
    finally:
        logging.getLogger("ddp_plugins").removeHandler(messages)
    return {
        "reference": (_state(reference), reference.steps),
        "resumed": (_state(resumed), resumed.steps),
        "steps_per_epoch": resumed.trainer.num_training_batches,
        "messages": messages.lines,
    }


def _assert_bitwise(ranks: list[dict]) -> None:
    for rank, result in enumerate(ranks):
        (expected, expected_steps), (got, got_steps) = result["reference"], result["resumed"]
        first, steps, per_epoch = min(got_steps), max(expected_steps) + 1, result["steps_per_epoch"]
        assert STOP_AT <= first < steps - 1 and first % per_epoch, f"resumed at step {first}, not inside an epoch"
        assert sorted(got_steps) == list(range(first, steps)), sorted(got_steps)
        inexact = [line for line in result["messages"] if "not an exact continuation" in line]
        assert not inexact, f"rank {rank}: the resume named an exact loader inexact: {inexact}"
        for step in sorted(got_steps):
            (loss, rows, state), (loss_ref, rows_ref, state_ref) = got_steps[step], expected_steps[step]
            assert rows == rows_ref, f"rank {rank} step {step}: rows {rows} after the resume, {rows_ref} uninterrupted"
            assert state == state_ref, f"rank {rank} step {step}: the global random state differs after the resume"
            assert torch.equal(loss, loss_ref), (
                f"rank {rank} step {step}: loss {loss.item():.6f} after the resume, {loss_ref.item():.6f} uninterrupted"
            )
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (
                f"rank {rank} {name}: differs by {(got[name].double() - tensor.double()).abs().max().item():.3g}"
            )


PER_RANK, PLAN, UNSPLIT = (
    {},
    {"strategy": {"global_batch_size": 2 * BATCH}},
    {"trainer": {"use_distributed_sampler": False}},
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loader", "setting"),
    [("shuffle", PER_RANK), ("shuffle", PLAN), ("shuffle_persistent", PLAN), ("shuffle", UNSPLIT)],
    ids=["per-rank", "plan", "plan-persistent", "unsplit"],
)
def test_a_shuffled_loader_without_generator_resumes_bitwise_with_dropout(loader, setting):
    _assert_bitwise(run_lightning(_stop_and_resume, loader, setting, world_size=2, timeout=240))


@pytest.mark.slow
@pytest.mark.parametrize("setting", [PER_RANK, UNSPLIT], ids=["split-by-lightning", "one-per-rank"])
def test_a_sampler_of_the_users_own_resumes_bitwise(setting):
    _assert_bitwise(run_lightning(_stop_and_resume, "own_sampler", setting, world_size=2, timeout=240))


def test_a_global_plan_refuses_a_sampler_of_the_users_own():
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    from ddp_plugins.lightning.data_plan import plan_for

    wrapped = DistributedSamplerWrapper(_OwnShuffle(ROWS), num_replicas=2, rank=0)
    loader = DataLoader(_Rows(), batch_size=BATCH, sampler=wrapped)
    with pytest.raises(ValueError, match="has a sampler of its own .*Leave global_batch_size unset"):
        plan_for(loader, 2 * BATCH, drop_last=False, world_size=2, accumulate=1)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_a_loader_that_cannot_be_made_exact_is_named_in_one_line():
    from ddp_plugins.lightning.data_plan import _inexact, _resumable_train_loader

    own = DataLoader(_Rows(), batch_size=BATCH, sampler=RandomSampler(range(ROWS), generator=torch.Generator()))
    named = {
        "stream": _inexact(DataLoader(_Stream(), batch_size=2), None),
        "batches": _inexact(DataLoader(_Rows(), batch_sampler=[[0, 1], [2, 3]]), None),
        "own generator": _inexact(own, _resumable_train_loader(own, rank=0, epoch=0, done=0)),
    }
    assert "over an IterableDataset is used as it is" in named["stream"], named
    assert "with a list is used as it is" in named["batches"], named
    assert "has a RandomSampler with a generator of its own, which no checkpoint holds" in named["own generator"], named
    plain = DataLoader(_Rows(), batch_size=BATCH, shuffle=True, num_workers=2)
    assert _inexact(plain, _resumable_train_loader(plain, rank=0, epoch=0, done=0)) is None
