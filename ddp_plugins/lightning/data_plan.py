"""Exact epochs for Lightning: the training data's plan, per-step rows and resume wiring.

:class:`TrainData` is held by :class:`~ddp_plugins.lightning.DDPPluginsStrategy`, which delegates
its training-loader, batch-start, checkpoint and per-step agreement work to it. Rationale in
docs/design.md ("One global plan per epoch, and uneven data", "Checkpoints and resume").
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ddp_plugins._compat import update_dataloader
from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.core.plan import EmptyShareCollate, EvenSteps, GlobalPlan, PlanBatchSampler
from ddp_plugins.core.samplers import ResumableSampler
from ddp_plugins.lightning.accumulation import current_accumulation
from ddp_plugins.lightning.contracts import AccumulationSchedule, of_kind

__all__ = [
    "ResumeMismatch",
    "StepRows",
    "TrainData",
    "check_global_batch",
    "check_resume",
    "data_record",
    "planned_train_loader",
    "run_accumulation",
]

CHECKPOINT_KEY = "ddp_plugins_data"


class ResumeMismatch(ValueError):
    """A checkpoint's data layout that this run cannot continue exactly (one line, names what changed)."""


@dataclass(frozen=True)
class StepRows:
    """Rows of the current micro-batch: this rank's, all ranks', and the optimizer step's."""

    rank_rows: int
    micro_rows: int
    step_rows: int
    loss_weight: float


def _shuffle_and_seed(sampler: Any) -> tuple[bool, int]:
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle), int(sampler.seed)
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    if isinstance(sampler, RandomSampler):
        return True, seed
    if isinstance(sampler, SequentialSampler):
        return False, seed
    raise ArgumentValueError(
        "global_batch_size",
        "used with a DataLoader whose sampler is Lightning's DistributedSampler, a RandomSampler or a"
        " SequentialSampler",
        problem=f"the training DataLoader has a {type(sampler).__name__}",
        hint="Leave global_batch_size unset to keep your sampler (each rank then takes its own batches).",
    )


def planned_train_loader(
    dataloader: Any, global_batch_size: int, drop_last: bool, rank: int, world_size: int, accumulate: int,
    epoch: int, batches_done: int,
) -> tuple[DataLoader, GlobalPlan, int]:  # fmt: skip
    """The training loader on the global plan, starting after ``batches_done`` of ``epoch``.

    Returns the loader, its plan and the epoch its first iteration is in. ``batch_size``,
    ``shuffle`` and ``sampler`` of the given loader are replaced (the shuffle flag and seed are
    kept); workers, ``collate_fn``, ``pin_memory`` and the rest are kept. A ``DataLoader``
    subclass, an iterable dataset or a custom batch sampler is refused with one line: their rows
    cannot be planned globally.
    """
    what = "a torch.utils.data.DataLoader over a map-style dataset (with a length) and a plain sampler"
    if type(dataloader) is not DataLoader:
        raise ArgumentValueError("global_batch_size", f"used with {what}", problem=f"got a {type(dataloader).__name__}")
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ArgumentValueError(
            "global_batch_size", f"used with {what}", problem=f"the dataset is a {type(dataset).__name__}"
        )
    if dataloader.batch_size is None:
        raise ArgumentValueError("global_batch_size", f"used with {what}", problem="the DataLoader has a batch sampler")
    check_global_batch(global_batch_size, world_size, accumulate)
    shuffle, seed = _shuffle_and_seed(dataloader.sampler)
    plan = GlobalPlan(len(dataset), global_batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)
    per_epoch = plan.steps_per_epoch * accumulate
    if batches_done >= per_epoch:  # the checkpoint ended its epoch: the next one starts afresh
        epoch, batches_done = epoch + 1, 0
    if batches_done % accumulate:
        raise ResumeMismatch(
            f"resume: the checkpoint is {batches_done} micro-batches into epoch {epoch}, inside an accumulation"
            f" window of {accumulate}; resume from a checkpoint taken at an optimizer step."
        )
    sampler = PlanBatchSampler(plan, rank, world_size, accumulate, epoch=epoch, start_step=batches_done // accumulate)
    kwargs: dict[str, Any] = {
        "batch_sampler": sampler,
        "num_workers": dataloader.num_workers,
        "collate_fn": EmptyShareCollate(dataloader.collate_fn, dataset[0]),
        "pin_memory": dataloader.pin_memory,
        "timeout": dataloader.timeout,
        "worker_init_fn": dataloader.worker_init_fn,
        "multiprocessing_context": dataloader.multiprocessing_context,
        "generator": dataloader.generator,
        "persistent_workers": dataloader.persistent_workers,
        "pin_memory_device": dataloader.pin_memory_device,
    }
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    return DataLoader(dataset, **kwargs), plan, epoch


def check_global_batch(global_batch_size: int, world_size: int, accumulate: int) -> None:
    """Refuse a global batch too small to give every micro-batch of every rank a row in full steps.

    Raises:
        ArgumentValueError: ``global_batch_size`` below ``world_size * accumulate``.
    """
    if global_batch_size < world_size * accumulate:
        raise ArgumentValueError(
            "global_batch_size",
            f"at least world size x accumulate_grad_batches ({world_size} x {accumulate} = {world_size * accumulate})",
            global_batch_size,
            hint="Smaller global batches would leave part of every step without rows.",
        )


def step_rows(plan: GlobalPlan, batch_idx: int, rank: int, world_size: int, accumulate: int) -> StepRows:
    """The rows of micro-batch ``batch_idx`` of an epoch on the plan (no communication)."""
    step, micro = divmod(batch_idx, accumulate)
    counts = plan.counts(step, world_size, accumulate)
    return StepRows(
        rank_rows=counts[rank][micro],
        micro_rows=sum(c[micro] for c in counts),
        step_rows=plan.step_size(step),
        loss_weight=plan.loss_weight(step, micro, rank, world_size, accumulate),
    )


def data_record(dataloader: Any, plan: GlobalPlan | None, world_size: int, accumulate: int) -> dict[str, Any]:
    """What a checkpoint stores about the training data's layout (plain Python values)."""
    record: dict[str, Any] = {"world_size": world_size, "accumulate": accumulate}
    if plan is not None:
        record["plan"] = plan.state()
        return record
    sampler = getattr(dataloader, "sampler", None)
    sampler = getattr(sampler, "sampler", sampler)  # inside a ResumableSampler
    record["batch_size"] = getattr(dataloader, "batch_size", None)
    if isinstance(sampler, DistributedSampler):
        length = len(cast(Sized, sampler.dataset))
        record.update(seed=int(sampler.seed), shuffle=bool(sampler.shuffle), dataset_length=length)
    return record


def check_resume(saved: dict[str, Any] | None, now: dict[str, Any], mid_epoch: bool) -> None:
    """Refuse a resume that would train some of the epoch's rows twice or never.

    A planned run continues on any number of ranks when the plan is the same. A plain loader
    continues in the middle of an epoch only with the same world size, per-rank batch and seed
    (its order and its skipped rows depend on them); at an epoch boundary anything may change.

    Raises:
        ResumeMismatch: one line naming what changed and what is allowed.

    Example::

        >>> plan = {"dataset_length": 100, "global_batch_size": 8, "seed": 0, "shuffle": True, "drop_last": False}
        >>> check_resume({"plan": plan, "world_size": 2, "accumulate": 1},
        ...              {"plan": plan, "world_size": 3, "accumulate": 1}, mid_epoch=True)  # another world size: fine
        >>> check_resume({"world_size": 2, "accumulate": 1, "batch_size": 32, "seed": 0},
        ...              {"world_size": 1, "accumulate": 1, "batch_size": 32, "seed": 0}, mid_epoch=True)
        Traceback (most recent call last):
        ...
        ddp_plugins.lightning.data_plan.ResumeMismatch: resume: the checkpoint stopped in the middle of an epoch ...
    """
    if not saved or not mid_epoch:
        return
    if "plan" in saved or "plan" in now:
        if "plan" not in now or "plan" not in saved:
            side = "the checkpoint" if "plan" in saved else "this run"
            changes = [f"only {side} trains on a global plan (global_batch_size)"]
        else:
            before, after = saved["plan"], now["plan"]
            changes = [f"{k} {before.get(k)!r} -> {after[k]!r}" for k in after if before.get(k) != after[k]]
            if saved.get("accumulate") != now.get("accumulate"):
                changes.append(f"accumulate_grad_batches {saved.get('accumulate')} -> {now.get('accumulate')}")
        if changes:
            raise ResumeMismatch(
                "resume: the checkpoint stopped in the middle of an epoch and its data plan differs from this run's ("
                + "; ".join(changes)
                + "): rows would be trained twice or never. Resume with the same global_batch_size, seed, dataset,"
                " drop_last and accumulation (the number of ranks may change)."
            )
        return
    keys = ("world_size", "batch_size", "seed", "shuffle", "dataset_length", "accumulate")
    changes = [f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in keys if k in saved and saved.get(k) != now.get(k)]
    if changes:
        raise ResumeMismatch(
            "resume: the checkpoint stopped in the middle of an epoch and this run splits the data differently ("
            + "; ".join(changes)
            + "): its rows would be trained twice or never. Resume with the same ranks, batch size and seed, or"
            " train with a global batch (global_batch_size=G), which resumes on any number of ranks."
        )


class TrainData:
    """The training data of one strategy's fits: its plan or uneven-shard agreement, the rows of the
    current micro-batch, the per-step flags, and what checkpoints record and resumes check.

    Written by hand because Lightning trains every rank on ``DistributedSampler``'s padded,
    world-size-dependent split and has no notion of rows per step (issue 3325 and its kin).

    Args:
        global_batch_size: rows per optimizer step over all ranks and micro-batches (a global
            plan), or ``None`` for per-rank batches.
        drop_last: drop the plan's short last step.
        uneven_data: step ranks together over loaders that may yield different numbers of batches.
    """

    def __init__(self, global_batch_size: int | None, drop_last: bool, uneven_data: bool) -> None:
        self.global_batch_size = global_batch_size
        self.drop_last = drop_last
        self.uneven_data = uneven_data
        self.plan: GlobalPlan | None = None
        self.even: EvenSteps | None = None
        self.accumulate = 1  # micro-batches per optimizer step of the plan
        self.rows: StepRows | None = None  # the current micro-batch's (planned or uneven training)
        self.record: dict[str, Any] | None = None  # the training data's layout, for checkpoints
        self.resumed: dict[str, Any] | None = None  # the record in the checkpoint resumed from
        self._flag_sources: list[Callable[[], int]] = []
        self._agreed = 0  # the flag agreed with the current batch's counts (uneven data)

    def train_loader(self, dataloader: Any, trainer: Any, rank: int, world_size: int, device: torch.device) -> Any:
        """The training loader this run trains on (planned, in step across shards, or resumable)."""
        planned = self.global_batch_size is not None
        self.accumulate = run_accumulation(trainer) if planned else trainer.accumulate_grad_batches
        progress = trainer.fit_loop.epoch_loop.batch_progress
        done = progress.current.processed
        self.plan = self.even = None
        self.rows = None
        if self.global_batch_size is not None:
            dataloader, self.plan, epoch = planned_train_loader(
                dataloader, self.global_batch_size, self.drop_last, rank, world_size, self.accumulate,
                trainer.current_epoch, done,
            )  # fmt: skip
            mid_epoch = epoch == trainer.current_epoch and done > 0
            _quiet_mid_epoch_resume_warning()
        elif self.uneven_data and world_size > 1 and _per_rank_shards(dataloader):
            length = _agreed_length(dataloader, device)
            mid_epoch = done > 0 and not progress.is_last_batch and (length is None or done < length)
            dataloader = self.even = EvenSteps(
                dataloader,
                rows_of=extract_batch_size,
                device=device,
                length=length,
                flag=self._flag,
                window=lambda: current_accumulation(trainer),
                start=done if mid_epoch else 0,
            )
            if mid_epoch:
                _quiet_mid_epoch_resume_warning()
        else:
            mid_epoch = 0 < done < _length(dataloader)
            dataloader = _resumable_train_loader(dataloader, trainer)
        self.record = data_record(dataloader, self.plan, world_size, self.accumulate)
        check_resume(self.resumed, self.record, mid_epoch)
        return dataloader

    def batch_start(self, trainer: Any, batch_idx: int, rank: int, world_size: int) -> None:
        """Set :attr:`rows` for the micro-batch about to be trained."""
        if self.even is not None and self.even.steps:
            mine, micro, step, self._agreed = self.even.steps.popleft()  # counted and agreed when fetched
            k = current_accumulation(trainer)
            weight = world_size * k * mine / step if step else 0.0
            self.rows = StepRows(rank_rows=mine, micro_rows=micro, step_rows=step, loss_weight=weight)
        if self.plan is not None:
            if trainer.accumulate_grad_batches != self.accumulate:
                raise ArgumentValueError(
                    "accumulate_grad_batches",
                    f"the {self.accumulate} the global plan was made with, for the whole run",
                    trainer.accumulate_grad_batches,
                    hint="A schedule that changes it needs global_batch_size unset.",
                )
            self.rows = step_rows(self.plan, batch_idx, rank, world_size, self.accumulate)

    def checkpoint_record(self, module: Any) -> dict[str, Any] | None:
        """What a checkpoint stores: the layout, and on a plan its epoch and the global rows done.

        ``module`` is the LightningModule (``None`` or detached once a spawned fit has ended: the
        training position is then not needed, only the layout).
        """
        if self.record is None:
            return None
        if self.plan is None or module is None:
            return dict(self.record)
        trainer = module.trainer
        steps = trainer.fit_loop.epoch_loop.batch_progress.current.processed // self.accumulate
        rows = sum(self.plan.step_size(step) for step in range(min(steps, self.plan.steps_per_epoch)))
        return dict(self.record, epoch=trainer.current_epoch, rows_done=rows)

    # The per-step agreement (contracts.StepAgreement), through the strategy

    def add_flag_source(self, source: Callable[[], int]) -> None:
        if source not in self._flag_sources:
            self._flag_sources.append(source)

    def remove_flag_source(self, source: Callable[[], int]) -> None:
        if source in self._flag_sources:
            self._flag_sources.remove(source)

    def agreed_flag(self) -> int | None:
        return self._agreed if self.even is not None else None

    def _flag(self) -> int:
        return max((int(source()) for source in self._flag_sources), default=0)


def run_accumulation(trainer: Any) -> int:
    """The micro-batches per optimizer step of the whole run, known before its first epoch starts.

    Callbacks that set ``trainer.accumulate_grad_batches`` per epoch say so through
    :class:`~ddp_plugins.lightning.contracts.AccumulationSchedule`; a global plan needs one value
    for the run.

    Raises:
        ArgumentValueError: the schedule changes K.
    """
    values = {trainer.accumulate_grad_batches}
    for callback in of_kind(trainer.callbacks, AccumulationSchedule):
        if callback.scheduling and dict(callback.scheduling) != {0: 1}:  # {0: 1}: no accumulation asked there
            values = set(callback.scheduling.values())
    if len(values) > 1:
        raise ArgumentValueError(
            "accumulate_grad_batches",
            "one value for the whole run with global_batch_size",
            f"a schedule of {sorted(values)}",
        )
    return int(values.pop())


def _quiet_mid_epoch_resume_warning() -> None:
    """Lightning warns that a mid-epoch resume of a plain DataLoader is unreliable; the loaders
    built here (a plan, shards in step, a resumable sampler) resume exactly."""
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before")


def _per_rank_shards(dataloader: Any) -> bool:
    """Whether ranks may yield different numbers of batches: anything but Lightning's ``DistributedSampler``."""
    if not isinstance(dataloader, DataLoader):
        return True
    if isinstance(dataloader.dataset, IterableDataset):
        return True
    sampler = getattr(dataloader.batch_sampler, "sampler", None) or dataloader.sampler
    return not isinstance(sampler, DistributedSampler)


def _length(dataloader: Any) -> float:
    try:
        return len(dataloader)
    except TypeError:
        return float("inf")


def _agreed_length(dataloader: Any, device: torch.device) -> int | None:
    """The longest rank's batch count (``None`` when a rank's loader has no length): one all_reduce."""
    local = _length(dataloader)
    local = -1 if local == float("inf") else int(local)
    both = torch.tensor([local, -local], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    longest, shortest = int(both[0]), -int(both[1])
    return None if shortest < 0 else longest


def _resumable_train_loader(dataloader: Any, trainer: Any) -> Any:
    """The training DataLoader with its distributed sampler wrapped in a :class:`ResumableSampler`.

    A run resumed in the middle of an epoch skips the batches it already trained (the epoch
    loop's restored count of processed batches); every run draws the workers' base seed from the
    sampler's own generator, not the global stream. Loaders without a ``DistributedSampler`` (or
    with a custom batch sampler) are left as they are.
    """
    if not isinstance(dataloader, DataLoader) or not isinstance(dataloader.sampler, DistributedSampler):
        return dataloader
    if type(dataloader.batch_sampler) is not BatchSampler or dataloader.batch_size is None:
        return dataloader
    epoch = trainer.current_epoch
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    if done >= len(dataloader):  # the checkpoint ended its epoch: the next one starts afresh
        epoch, done = epoch + 1, 0
    _quiet_mid_epoch_resume_warning()
    seed = None if dataloader.generator is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
    sampler = ResumableSampler(dataloader.sampler, done * dataloader.batch_size, epoch, seed, trainer.global_rank)
    rebuilt = update_dataloader(dataloader, sampler)
    if seed is not None:
        rebuilt.generator = sampler.generator
    return rebuilt
