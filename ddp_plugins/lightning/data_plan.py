"""Exact epochs: the training loader of a global plan, uneven shards in step, each micro-batch's rows.

See docs/design.md, "One global plan per epoch, and uneven data"."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ddp_plugins._compat import update_dataloader
from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.core.plan import EmptyShareCollate, EvenSteps, GlobalPlan, PlanBatchSampler
from ddp_plugins.core.ranks import collective_device
from ddp_plugins.core.samplers import ResumableSampler
from ddp_plugins.core.timeline import collective_kind
from ddp_plugins.lightning.accumulation import current_accumulation
from ddp_plugins.lightning.contracts import AccumulationSchedule, of_kind
from ddp_plugins.lightning.resume import ResumeMismatch, ResumeRecord, data_record

log = logging.getLogger(__name__)

__all__ = [
    "BatchRows",
    "PlannedLoader",
    "UnevenShards",
    "check_global_batch",
    "plan_for",
    "run_accumulation",
    "train_loader",
]


@dataclass(frozen=True)
class BatchRows:
    """Rows of the current micro-batch: this rank's, all ranks', and the optimizer step's."""

    rank_rows: int
    micro_rows: int
    step_rows: int
    loss_weight: float


def _shuffle_and_seed(sampler: Any) -> tuple[bool, int]:
    wrapped = isinstance(sampler, DistributedSamplerWrapper)  # Lightning's wrapper of a sampler of the user's own
    if isinstance(sampler, DistributedSampler) and not wrapped:
        return bool(sampler.shuffle), int(sampler.seed)
    if isinstance(sampler, (RandomSampler, SequentialSampler)):
        return isinstance(sampler, RandomSampler), _base_seed()
    allowed = "used with a DataLoader whose sampler is Lightning's DistributedSampler, a RandomSampler or a"
    has = (
        "a sampler of its own (in Lightning's DistributedSamplerWrapper)" if wrapped else f"a {type(sampler).__name__}"
    )
    raise ArgumentValueError(
        "global_batch_size", f"{allowed} SequentialSampler", problem=f"the training DataLoader has {has}",
        hint="The plan would replace its order. Leave global_batch_size unset to keep your sampler.",
    )  # fmt: skip


def plan_for(
    dataloader: Any, global_batch_size: int, drop_last: bool, world_size: int, accumulate: int,
    virtual_shards: int | None = None,
) -> GlobalPlan:  # fmt: skip
    """The global plan of a training loader's rows (``ArgumentValueError`` where they cannot be planned)."""
    dataset: Any = getattr(dataloader, "dataset", None)
    if type(dataloader) is not DataLoader:
        problem: str | None = f"got a {type(dataloader).__name__}"
    elif isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        problem = f"the dataset is a {type(dataset).__name__}"
    else:
        problem = "the DataLoader has a batch sampler" if dataloader.batch_size is None else None
    if problem is not None:
        what = "used with a torch.utils.data.DataLoader over a map-style dataset (with a length) and a plain sampler"
        raise ArgumentValueError("global_batch_size", what, problem=problem)
    check_global_batch(global_batch_size, world_size, accumulate)
    shuffle, seed = _shuffle_and_seed(dataloader.sampler)
    return GlobalPlan(
        len(dataset), global_batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last, virtual_shards=virtual_shards
    )


_KEPT_LOADER_ARGS = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                     "generator", "persistent_workers", "pin_memory_device")  # fmt: skip


def _plan_loader(
    dataloader: DataLoader, plan: GlobalPlan, rank: int, world_size: int, accumulate: int, epoch: int, start: int
) -> DataLoader:
    """``dataloader`` on this rank's batches of ``plan``, its first iteration ``start`` micro-batches into ``epoch``."""
    if start % accumulate:
        raise ResumeMismatch(
            f"resume: the checkpoint is {start} micro-batches into epoch {epoch}, inside an accumulation"
            f" window of {accumulate}; resume from a checkpoint taken at an optimizer step."
        )
    batches = PlanBatchSampler(plan, rank, world_size, accumulate, epoch=epoch, start_step=start // accumulate)
    sampler = ResumableSampler(batches, epoch=epoch, seed=_base_seed(), rank=rank)  # the generator's epochs
    kwargs = {name: getattr(dataloader, name) for name in _KEPT_LOADER_ARGS}
    if kwargs["generator"] is None:  # else making an iterator draws the workers' seed from the global stream
        kwargs["generator"] = sampler.generator
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    collate = EmptyShareCollate(dataloader.collate_fn, dataloader.dataset[0])
    return DataLoader(dataloader.dataset, batch_sampler=sampler, collate_fn=collate, **kwargs)


def check_global_batch(global_batch_size: int, world_size: int, accumulate: int) -> None:
    """Refuse (``ArgumentValueError``) a global batch below ``world_size * accumulate`` (micro-batches without rows)."""
    if global_batch_size < world_size * accumulate:
        raise ArgumentValueError(
            "global_batch_size",
            f"at least world size x accumulate_grad_batches ({world_size} x {accumulate} = {world_size * accumulate})",
            global_batch_size,
            hint="Smaller global batches would leave part of every step without rows.",
        )


def train_loader(
    dataloader: Any, trainer: Any, rank: int, world_size: int, planned: PlannedLoader, uneven: UnevenShards,
    resume: ResumeRecord,
) -> Any:  # fmt: skip
    """The training loader (planned, uneven shards in step, or resumable), starting where :func:`resume_start` says."""
    uneven.loader = None
    plan = planned.make_plan(dataloader, trainer, world_size)
    accumulate = planned.accumulate if plan is not None else trainer.accumulate_grad_batches
    in_step = plan is None and uneven.enabled and world_size > 1 and _per_rank_shards(dataloader)
    if plan is not None:
        length: int | None = plan.steps_per_epoch * accumulate
    else:
        length = _agreed_length(dataloader) if in_step else sized_len(dataloader)
    epoch, start = resume.start(data_record(dataloader, plan, world_size, accumulate), length, trainer)
    if plan is not None:
        return _plan_loader(dataloader, plan, rank, world_size, accumulate, epoch, start)
    own = _resumable_train_loader(dataloader, rank, epoch, 0 if in_step else start)  # EvenSteps skips itself
    loader = uneven.step_together(own or dataloader, trainer, length, start) if in_step else own or dataloader
    if resume.resumed and rank == 0 and (inexact := _inexact(dataloader, own)):
        log.warning(
            f"resume: the training DataLoader {inexact}, so the random numbers the resumed steps see (dropout) or"
            " its order may differ from the uninterrupted run's: not an exact continuation. For an exact resume, use a"
            " map-style dataset with batch_size= and a sampler that has __len__."
        )
    return loader


class PlannedLoader:
    """A global plan of the training loader's rows (``None`` without ``global_batch_size``), its micro-batches' rows."""

    def __init__(self, global_batch_size: int | None, drop_last: bool, virtual_shards: int | None = None) -> None:
        self.global_batch_size = global_batch_size
        self.drop_last = drop_last
        self.virtual_shards = virtual_shards
        self.plan: GlobalPlan | None = None  # the current training loader's
        self.accumulate = 1  # micro-batches per optimizer step of the plan

    def make_plan(self, dataloader: Any, trainer: Any, world_size: int) -> GlobalPlan | None:
        """The plan of a new training loader (``None`` without ``global_batch_size``)."""
        self.plan = None
        if self.global_batch_size is not None:
            self.accumulate = run_accumulation(trainer)
            self.plan = plan_for(
                dataloader, self.global_batch_size, self.drop_last, world_size, self.accumulate, self.virtual_shards
            )
        return self.plan

    def batch_rows(self, trainer: Any, batch_idx: int, rank: int, world_size: int) -> BatchRows | None:
        """The rows of micro-batch ``batch_idx`` of the epoch (``None`` without a plan; no communication).

        Raises:
            ArgumentValueError: ``accumulate_grad_batches`` differs from the plan's.
        """
        if self.plan is None:
            return None
        if trainer.accumulate_grad_batches != self.accumulate:
            raise ArgumentValueError(
                "accumulate_grad_batches",
                f"the {self.accumulate} the global plan was made with, for the whole run",
                trainer.accumulate_grad_batches,
                hint="A schedule that changes it needs global_batch_size unset.",
            )
        step, micro = divmod(batch_idx, self.accumulate)
        counts = self.plan.counts(step, world_size, self.accumulate)
        return BatchRows(
            rank_rows=counts[rank][micro],
            micro_rows=sum(c[micro] for c in counts),
            step_rows=self.plan.step_size(step),
            loss_weight=self.plan.loss_weight(step, micro, rank, world_size, self.accumulate),
        )

    def position(self, trainer: Any) -> dict[str, int]:
        """On a plan, the epoch and the global rows trained in it (what a checkpoint adds); else nothing."""
        if self.plan is None:
            return {}
        steps = trainer.fit_loop.epoch_loop.batch_progress.current.processed // self.accumulate
        rows = sum(self.plan.step_size(step) for step in range(min(steps, self.plan.steps_per_epoch)))
        return {"epoch": trainer.current_epoch, "rows_done": rows}


class UnevenShards:
    """Loaders of uneven lengths per rank in step (``EvenSteps``): their rows, and ``sources``' largest flag agreed."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.sources: dict[Callable[[], int], None] = {}  # an ordered set
        self.loader: EvenSteps | None = None  # the current training loader, when it steps shards together
        self._agreed = 0  # the flag agreed with the current batch's counts

    def step_together(self, dataloader: Any, trainer: Any, length: int | None, start: int) -> EvenSteps:
        """``dataloader`` in step with the other ranks' (``length``: the agreed batches), ``start`` batches in."""
        self.loader = EvenSteps(
            dataloader,
            rows_of=extract_batch_size,
            length=length,
            flag=self._raised,
            window=lambda: current_accumulation(trainer),
            start=start,
        )
        return self.loader

    def batch_rows(self, trainer: Any, world_size: int) -> BatchRows | None:
        """The rows of the micro-batch about to be trained, counted and agreed when it was fetched."""
        if self.loader is None or not self.loader.batch_counts:
            return None
        mine, micro, step, self._agreed = self.loader.batch_counts.popleft()
        weight = world_size * current_accumulation(trainer) * mine / step if step else 0.0
        return BatchRows(rank_rows=mine, micro_rows=micro, step_rows=step, loss_weight=weight)

    def _raised(self) -> int:
        return max((int(source()) for source in self.sources), default=0)

    @property
    def agreed_flag(self) -> int | None:
        """The largest flag any rank raised, agreed with the current batch's counts (``None``: no round)."""
        return self._agreed if self.loader is not None else None


def run_accumulation(trainer: Any) -> int:
    """The micro-batches per optimizer step of the whole run (``ArgumentValueError`` where a schedule changes it)."""
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


def _per_rank_shards(dataloader: Any) -> bool:
    """Whether ranks may yield different numbers of batches: anything but Lightning's ``DistributedSampler``."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return True
    sampler = getattr(dataloader.batch_sampler, "sampler", None) or dataloader.sampler
    return not isinstance(sampler, DistributedSampler)


def _agreed_length(dataloader: Any) -> int | None:
    """The longest rank's batch count (``None`` when a rank's loader has no length): one all_reduce."""
    local = sized_len(dataloader)
    local = -1 if local is None else local
    both = torch.tensor([local, -local], dtype=torch.int64, device=collective_device())
    with collective_kind("agreement", "all_reduce"):
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the longest count, and minus the shortest
    return None if int(both[1]) > 0 else int(both[0])


def _resumable_train_loader(dataloader: Any, rank: int, epoch: int, done: int) -> DataLoader | None:
    """The DataLoader on a :class:`ResumableSampler` starting ``done`` batches into ``epoch`` (``None``: impossible)."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return None
    if type(dataloader.batch_sampler) is not BatchSampler or not isinstance(dataloader.sampler, Sized):
        return None
    sampler = ResumableSampler(dataloader.sampler, done * cast(int, dataloader.batch_size), epoch, _base_seed(), rank)
    try:
        rebuilt = update_dataloader(dataloader, sampler)
    except (MisconfigurationException, TypeError):  # a DataLoader subclass Lightning cannot rebuild
        return None
    if dataloader.generator is None:
        rebuilt.generator = sampler.generator
    return rebuilt


def _inexact(dataloader: Any, rebuilt: DataLoader | None) -> str | None:
    """Why a training loader may not resume exactly (what a resume names in one line), else ``None``."""
    if rebuilt is None:
        if isinstance(dataloader, DataLoader) and not isinstance(dataloader.dataset, IterableDataset):
            batches, sampler = dataloader.batch_sampler, dataloader.sampler
            plain = batches is None or type(batches) is BatchSampler
            fixed = plain and isinstance(sampler, (SequentialSampler, DistributedSampler))
            if fixed and dataloader.generator is not None:
                return None  # its order is fixed and its workers' seed drawn from its own generator
            order = type(sampler if plain else batches).__name__
            return f"with a {order} is used as it is (it cannot be rebuilt with a sampler of ours)"
        what = "an IterableDataset" if isinstance(dataloader, DataLoader) else f"a {type(dataloader).__name__}"
        return f"over {what} is used as it is (it draws from the global random streams as it iterates)"
    inner = getattr(rebuilt.sampler, "sampler", None)
    if not isinstance(inner, DistributedSampler) and getattr(inner, "generator", None) is not None:
        return f"has a {type(inner).__name__} with a generator of its own, which no checkpoint holds"
    return None


def _base_seed() -> int:
    """The run's base seed (what ``DistributedSampler`` and :class:`ResumableSampler` key their streams by)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
