"""Exact epochs for Lightning: the global plan in the training loader, and resumes checked against it
=================================================================================================

:class:`~ddp_plugins.lightning.DDPPluginsStrategy` calls these; users set
``DDPPluginsStrategy(global_batch_size=G)``:

* :func:`planned_train_loader` replaces the training loader's sampler (Lightning's padded
  ``DistributedSampler``) by a :class:`~ddp_plugins.core.plan.PlanBatchSampler`: each step trains
  ``G`` rows of one per-epoch order, split over however many ranks run, with no padded row.
* :class:`StepRows` says how many rows this rank and all ranks train in the current micro-batch;
  the strategy weights the loss with it (gradients equal one process on the step's rows) and
  weights ``self.log(..., sync_dist=True)`` means by rows.
* :func:`data_record` is stored in every checkpoint (the plan, or the world size, per-rank batch
  and seed of a plain loader, and the rows done); :func:`check_resume` refuses, with one line, a
  resume that would silently train rows twice or never: a changed plan, or a plain loader resumed
  in the middle of an epoch with another world size, batch size or seed. A planned run resumes on
  any number of ranks at the same global row.
"""

from __future__ import annotations

import os
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, cast

from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.core.plan import EmptyShareCollate, GlobalPlan, PlanBatchSampler

__all__ = ["ResumeMismatch", "StepRows", "check_resume", "data_record", "planned_train_loader"]

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
    if global_batch_size < world_size * accumulate:
        raise ArgumentValueError(
            "global_batch_size",
            f"at least world size x accumulate_grad_batches ({world_size} x {accumulate} = {world_size * accumulate})",
            global_batch_size,
            hint="Smaller global batches would leave part of every step without rows.",
        )
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
