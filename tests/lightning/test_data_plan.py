"""Where a resumed run starts, by the row ledger: no row of an epoch trained twice or never.

A run of one layout (world size, per-rank batch, seed, or a global plan) stops after ``done``
micro-batches of an epoch; a run of another layout restores that checkpoint. Both are the real
training loaders of :func:`~ddp_plugins.lightning.data_plan.train_loader` (the same code the strategy
runs, on a stand-in for Lightning's progress counters), iterated on every rank without processes.
The rows the stopped run trained plus the rows the resumed run trains in that epoch must equal the
rows of the uninterrupted run (the reference), or the resume is refused with one line; and a
refusal is only where continuing would break the ledger. Stops at an epoch's first, a middle and
its last batch, and at its end (issue 35: stops past the new run's whole epoch were taken for epoch
ends and retrained). The app's end-to-end runs are in ``tests/app/test_exact_epochs.py``.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_plugins.core.plan import GlobalPlan
from ddp_plugins.lightning.data_plan import PlannedLoader, UnevenShards, train_loader
from ddp_plugins.lightning.resume import ResumeMismatch, ResumeRecord, data_record, expected_record, resume_start

ROWS, EPOCH = 53, 1  # epoch 1: the epoch a resume starts in is not 0 by chance


class Layout(NamedTuple):
    """How a run splits the training rows: ``global_batch_size`` (a plan) or per-rank ``batch_size``."""

    world_size: int
    batch_size: int = 4
    seed: int = 7
    global_batch_size: int | None = None


def _progress(done: int) -> SimpleNamespace:
    """Lightning's restored batch counters of a checkpoint taken after ``done`` batches (at a step's end)."""
    return SimpleNamespace(current=SimpleNamespace(processed=done, completed=done), is_last_batch=False)


def _trainer(epoch: int, done: int, rank: int, batches: int | None = None) -> SimpleNamespace:
    loop = SimpleNamespace(batch_progress=_progress(done))
    return SimpleNamespace(accumulate_grad_batches=1, callbacks=[], current_epoch=epoch, global_rank=rank,
                           limit_train_batches=1.0, num_training_batches=batches,
                           fit_loop=SimpleNamespace(epoch_loop=loop))  # fmt: skip


class Parts(NamedTuple):
    """One rank's training-data parts, as the strategy holds them."""

    planned: PlannedLoader
    uneven: UnevenShards
    resume: ResumeRecord

    def loader(self, dataloader: DataLoader, trainer: Any, rank: int, world_size: int) -> Any:
        return train_loader(dataloader, trainer, rank, world_size, *self)


def _loader(layout: Layout, rank: int) -> DataLoader:
    """The training loader as Lightning hands it to the strategy (its ``DistributedSampler`` on a plain run)."""
    data = TensorDataset(torch.arange(ROWS))
    if layout.global_batch_size is not None:
        return DataLoader(data, batch_size=layout.batch_size, shuffle=True)  # the plan replaces batch size and sampler
    sampler = DistributedSampler(data, num_replicas=layout.world_size, rank=rank, shuffle=True, seed=layout.seed)
    return DataLoader(data, batch_size=layout.batch_size, sampler=sampler)


def _start(layout: Layout, epoch: int, done: int, resumed: dict | None, monkeypatch) -> list[Any]:
    """Every rank's :class:`Parts` with its training loader, restored ``done`` batches into ``epoch``."""
    monkeypatch.setenv("PL_GLOBAL_SEED", str(layout.seed))  # what seed_everything sets (the plan's seed)
    ranks = []
    for rank in range(layout.world_size):
        data = Parts(PlannedLoader(layout.global_batch_size, drop_last=False), UnevenShards(False), ResumeRecord())
        data.resume.checkpoint_loaded(resumed)
        loader = data.loader(_loader(layout, rank), _trainer(epoch, done, rank), rank, layout.world_size)
        ranks.append((data, loader))
    return ranks


def _batches(loader: DataLoader) -> list[list[int]]:
    """The rows of each batch of the loader's next iteration (the epoch it was made for)."""
    return [batch[0].tolist() for batch in loader]


def _epoch(layout: Layout, epoch: int, monkeypatch) -> list[list[int]]:
    """The reference: the rows of every batch index of an uninterrupted epoch, all ranks together."""
    per_rank = [_batches(loader) for _, loader in _start(layout, epoch, 0, None, monkeypatch)]
    return [sum(step, []) for step in zip(*per_rank, strict=True)]


def _stop(layout: Layout, done: int, monkeypatch) -> tuple[list[list[int]], dict]:
    """A run stopped after ``done`` batches of ``EPOCH``: the rows it trained there, and its checkpoint record."""
    ranks = _start(layout, EPOCH, 0, None, monkeypatch)
    trained = [sum(step, []) for step in zip(*(_batches(loader)[:done] for _, loader in ranks), strict=True)]
    data, loader = ranks[0]
    module = SimpleNamespace(trainer=_trainer(EPOCH, done, 0, batches=len(loader)))
    return trained, data.resume.checkpoint_record(module, data.planned)


def _resume(layout: Layout, done: int, record: dict | None, monkeypatch) -> list[list[int]] | str:
    """The rows per batch index a run of ``layout`` restored from ``record`` trains first, or its refusal."""
    try:
        ranks = _start(layout, EPOCH, done, record, monkeypatch)
        return [sum(step, []) for step in zip(*(_batches(loader) for _, loader in ranks), strict=True)]
    except (ResumeMismatch, ValueError) as err:  # ValueError: a naive resume past the new run's epoch
        return str(err)


BASES = {"plain": Layout(world_size=1), "planned": Layout(world_size=2, global_batch_size=8)}
CHANGES = {  # per base: a run that splits the epoch differently in one way (or not at all)
    "plain": {"none": {}, "world_size": {"world_size": 2}, "batch_size": {"batch_size": 8}, "seed": {"seed": 8},
              "global_batch": {"world_size": 2, "global_batch_size": 8}},
    "planned": {"none": {}, "world_size": {"world_size": 3}, "batch_size": {"global_batch_size": 16},
                "seed": {"seed": 8}, "global_batch": {"global_batch_size": None}},
}  # fmt: skip  # plain: 14 batches per epoch (7 after each change); planned: 7 steps (4 with G=16)
KEEPS_THE_EPOCH = {("planned", "world_size"), ("plain", "none"), ("planned", "none")}  # the same rows per step


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("change", ["none", "world_size", "batch_size", "seed", "global_batch"])
@pytest.mark.parametrize("stop", ["first", "middle", "last", "end"])
def test_a_resume_trains_each_row_of_the_stopped_epoch_once_or_is_refused_with_one_line(
    base, change, stop, monkeypatch
):
    old = BASES[base]
    new = old._replace(**CHANGES[base][change])
    reference = _epoch(old, EPOCH, monkeypatch)
    per_epoch = len(reference)
    done = {"first": 1, "middle": per_epoch // 2, "last": per_epoch - 1, "end": per_epoch}[stop]
    trained, record = _stop(old, done, monkeypatch)
    assert trained == reference[:done]
    resumed = _resume(new, done, record, monkeypatch)

    if stop == "end":  # the epoch is whole: the resumed run starts the next one, in its own layout
        assert resumed == _epoch(new, EPOCH + 1, monkeypatch), f"{change}: not the next epoch from its start"
    elif (base, change) in KEEPS_THE_EPOCH:  # the same epoch, from the next batch: the reference's
        assert trained + resumed == reference, f"{change} at batch {done} of {per_epoch}: not the reference's epoch"
    else:
        assert isinstance(resumed, str) and "\n" not in resumed, f"{change} at batch {done} of {per_epoch}: {resumed}"
        assert f"in the middle of an epoch (batch {done} of {per_epoch} of epoch {EPOCH})" in resumed, resumed
        # the refusal is needed: a run that took the checkpoint at its word would break the ledger
        naive = _resume(new, done, None, monkeypatch)
        rows = Counter(i for step in trained + (naive if isinstance(naive, list) else []) for i in step)
        assert rows != Counter(i for step in reference for i in step), f"{change}: refused a resume that was exact"


def test_the_two_late_stops_of_issue_35_are_refused_and_the_same_layout_continues():
    """1 rank, stopped at batch 38 of 45, resumed on 2 (23 batches per epoch); 2 ranks stopped at
    batch 22 of 23, resumed with batches of 64 (12 per epoch): both past the new run's whole epoch."""
    one = {"world_size": 1, "accumulate": 1, "batch_size": 32, "seed": 42, "shuffle": True, "dataset_length": 1438}
    two = dict(one, world_size=2, batches_per_epoch=23)
    for saved, now, done in [
        (dict(one, batches_per_epoch=45), two, 38),
        (two, dict(two, batch_size=64, batches_per_epoch=12), 22),
    ]:
        with pytest.raises(ResumeMismatch, match=rf"\(batch {done} of {saved['batches_per_epoch']} of epoch 0\)"):
            resume_start(saved, now, 0, done)
        assert resume_start(saved, dict(saved), 0, done) == (0, done)
        assert resume_start(saved, now, 0, saved["batches_per_epoch"]) == (1, 0)


PLAN = {"dataset_length": 100, "global_batch_size": 8, "seed": 0, "shuffle": True, "drop_last": False}


def test_records_without_a_batch_count_and_checkpoints_inside_the_last_batch():
    # a planned record from before `batches_per_epoch`: its plan gives the count (13 steps)
    old = {"plan": PLAN, "world_size": 2, "accumulate": 1}
    assert resume_start(old, dict(old, plan=dict(PLAN, global_batch_size=16)), 0, 13) == (1, 0)
    with pytest.raises(ResumeMismatch, match=r"\(batch 9 of 13 of epoch 0\)"):
        resume_start(old, dict(old, plan=dict(PLAN, global_batch_size=16)), 0, 9)
    # a plain record from before it: Lightning's is_last_batch of the checkpoint decides
    plain = {"world_size": 2, "accumulate": 1, "batch_size": 32, "seed": 0}
    assert resume_start(plain, dict(plain, world_size=1), 3, 20, last_batch=True) == (4, 0)
    with pytest.raises(ResumeMismatch, match=r"\(batch 20 of epoch 3\)"):
        resume_start(plain, dict(plain, world_size=1), 3, 20, last_batch=False)
    # written inside on_train_batch_end of its last batch: Lightning ends that epoch at the new run's
    # length, so a run with more batches per epoch would go on in it (refused); fewer or as many: the next epoch
    saved = dict(plain, batches_per_epoch=20)
    longer, shorter = dict(plain, world_size=1, batches_per_epoch=40), dict(plain, batch_size=64, batches_per_epoch=10)
    with pytest.raises(ResumeMismatch, match="world_size 2 -> 1"):
        resume_start(saved, longer, 0, 20, in_batch_end=True)
    assert resume_start(saved, shorter, 0, 20, in_batch_end=True) == (1, 0)
    assert resume_start(saved, longer, 0, 20, in_batch_end=False) == (1, 0)
    assert resume_start(None, longer, 0, 0) == (0, 0), "a fresh start"


def test_a_checkpoint_records_its_own_batches_per_epoch(monkeypatch):
    for layout, expected in [(Layout(world_size=2), 7), (Layout(world_size=3, global_batch_size=16), 4)]:
        _, record = _stop(layout, 1, monkeypatch)
        assert record["batches_per_epoch"] == expected == len(_epoch(layout, 0, monkeypatch)), record
    assert GlobalPlan(ROWS, 16).steps_per_epoch == 4


def test_a_loader_made_again_at_a_later_epoch_start_starts_that_epoch(monkeypatch):
    """``reload_dataloaders_every_n_epochs``: the loader is made again before Lightning resets the
    last epoch's counters. After a resume at an epoch's end in another layout, those counters (7
    batches of 2 ranks) are neither a stop in the old layout's epoch of 14 nor a position to skip."""
    old, new = Layout(world_size=1), Layout(world_size=2)
    _, record = _stop(old, 14, monkeypatch)
    ranks = _start(new, EPOCH, 14, record, monkeypatch)  # the resume: the next epoch
    reloaded = [
        data.loader(_loader(new, rank), _trainer(EPOCH + 2, 7, rank), rank, new.world_size)
        for rank, (data, _) in enumerate(ranks)
    ]
    rows = [sum(step, []) for step in zip(*(_batches(loader) for loader in reloaded), strict=True)]
    assert rows == _epoch(new, EPOCH + 2, monkeypatch)


@pytest.mark.parametrize(
    "layout",
    [Layout(1), Layout(2), Layout(3, batch_size=5), Layout(2, global_batch_size=12), Layout(3, global_batch_size=7)],
    ids=str,
)
def test_the_record_an_app_predicts_before_any_rank_starts_is_the_one_the_ranks_write(layout, monkeypatch):
    """The app refuses a resume before starting from :func:`expected_record`: it must be the real one."""
    for data, _ in _start(layout, EPOCH, 0, None, monkeypatch):
        predicted = expected_record(
            ROWS, layout.world_size, 1, layout.batch_size, layout.seed, global_batch_size=layout.global_batch_size
        )
        assert predicted == data.resume.record


class _Shard(torch.utils.data.IterableDataset):
    """A per-rank shard: each rank iterates its own rows (what ``uneven_data`` steps together)."""

    def __iter__(self):
        return iter(range(10))


def test_per_rank_shards_resume_exactly_on_the_same_world_size_and_are_refused_on_another():
    """Per-rank shards cannot be re-cut: in the middle of an epoch only the same world size continues
    (each rank skips its own batches), another is one line; at the epoch's end anything may change."""
    saved = {**data_record(DataLoader(_Shard(), batch_size=4), None, 2, 1), "batches_per_epoch": 3}
    on_three = {**data_record(DataLoader(_Shard(), batch_size=4), None, 3, 1), "batches_per_epoch": 3}
    assert resume_start(saved, dict(saved), epoch=EPOCH, done=2) == (EPOCH, 2)
    with pytest.raises(ResumeMismatch, match=r"world_size 2 -> 3.*train with a global batch") as refused:
        resume_start(saved, on_three, epoch=EPOCH, done=2)
    assert "\n" not in str(refused.value)
    assert resume_start(saved, on_three, epoch=EPOCH, done=3) == (EPOCH + 1, 0)
