"""Exact epochs for Lightning: the training data's plan, per-step rows and resume wiring.

Rationale in docs/design.md ("One global plan per epoch, and uneven data", "Checkpoints and resume")."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
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
from torchmetrics import Metric

from ddp_plugins import _compat
from ddp_plugins._compat import update_dataloader
from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.core.plan import EmptyShareCollate, EvenSteps, GlobalPlan, PlanBatchSampler
from ddp_plugins.core.ranks import collective_device
from ddp_plugins.core.samplers import PaddingApartSampler, ResumableSampler
from ddp_plugins.core.timeline import collective_kind
from ddp_plugins.lightning.accumulation import current_accumulation
from ddp_plugins.lightning.contracts import AccumulationSchedule, of_kind

log = logging.getLogger(__name__)

__all__ = [
    "BatchRows",
    "PlannedLoader",
    "PlannedSteps",
    "ResumeMismatch",
    "ResumeRecord",
    "UnevenShards",
    "check_global_batch",
    "check_resume",
    "data_record",
    "evaluation_sampler",
    "expected_record",
    "is_mean",
    "metrics_unchanged",
    "padding_apart_loader",
    "plan_for",
    "resume_start",
    "run_accumulation",
    "train_loader",
]

CHECKPOINT_KEY = "ddp_plugins_data"


class ResumeMismatch(ValueError):
    """A checkpoint's data layout that this run cannot continue exactly (one line, names what changed)."""


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


def padding_apart_loader(dataloader: Any, world_size: int, rank: int) -> Any:
    """``dataloader`` on this rank's :class:`PaddingApartSampler` (whole batches, padding rows in batches of
    their own), or ``None`` where its batches cannot be so: a dataset without a length, no ``batch_size``
    (a batch sampler), or ``drop_last``."""
    dataset = getattr(dataloader, "dataset", None)
    if (
        not isinstance(dataloader, DataLoader)
        or isinstance(dataset, IterableDataset)
        or not hasattr(dataset, "__len__")
    ):
        return None
    if not dataloader.batch_size or dataloader.drop_last or type(dataloader.batch_sampler) is not BatchSampler:
        return None
    batch_size = dataloader.batch_size
    sampler = PaddingApartSampler(dataloader.dataset, num_replicas=world_size, rank=rank, batch_size=batch_size)
    return update_dataloader(dataloader, sampler)


def evaluation_sampler(trainer: Any, args: tuple) -> Any:
    """The sampler of the loader the evaluation step of ``args`` (batch, batch index[, loader index]) runs on."""
    loaders = trainer.test_dataloaders if trainer.testing else trainer.val_dataloaders
    if isinstance(loaders, (list, tuple)):
        index = args[2] if len(args) > 2 else 0
        loaders = loaders[index] if len(loaders) > index else None
    return getattr(loaders, "sampler", None)


def padding_batch(trainer: Any, args: tuple) -> bool:
    """Whether the evaluation step of ``args`` (batch, batch index, loader index) runs a padding batch of a
    :class:`PaddingApartSampler`."""
    if len(args) < 2 or trainer is None:
        return False
    sampler = evaluation_sampler(trainer, args)
    return isinstance(sampler, PaddingApartSampler) and sampler.is_padding(int(args[1]))


@contextlib.contextmanager
def metrics_unchanged(module: Any) -> Any:
    """Every torchmetrics state of ``module`` gets its value from before the body back (torchmetrics has no
    public way to take an update back; the states are the ones ``Metric.metric_state`` lists)."""
    metrics = [m for m in (module.modules() if module is not None else ()) if isinstance(m, Metric)]
    states = [{k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in m.metric_state.items()}
              for m in metrics]  # fmt: skip
    try:
        yield
    finally:
        for metric, state in zip(metrics, states, strict=True):
            for name, value in state.items():
                setattr(metric, name, value)


@contextlib.contextmanager
def counts_for_nothing(trainer: Any, hook: str, module: Any) -> Any:
    """What ``hook``'s step logs and updates in the body counts for nothing (an empty micro-batch's NaN
    mean, a padding batch's rows): every epoch sum of ``self.log`` and every torchmetrics state of
    ``module`` get their values from before. Lightning has no public way to take a logged value back."""
    results = _compat.running_results(trainer, hook)
    sums = _compat.epoch_sums(results)
    try:
        with metrics_unchanged(module):
            yield
    finally:
        _compat.restore_epoch_sums(results, sums)


def check_global_batch(global_batch_size: int, world_size: int, accumulate: int) -> None:
    """Refuse (``ArgumentValueError``) a global batch below ``world_size * accumulate``: too small to
    give every micro-batch of every rank a row in full steps."""
    if global_batch_size < world_size * accumulate:
        raise ArgumentValueError(
            "global_batch_size",
            f"at least world size x accumulate_grad_batches ({world_size} x {accumulate} = {world_size * accumulate})",
            global_batch_size,
            hint="Smaller global batches would leave part of every step without rows.",
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


def expected_record(
    dataset_length: int, world_size: int, accumulate: int, batch_size: int, seed: int, *, shuffle: bool = True,
    global_batch_size: int | None = None, drop_last: bool = False, limit_train_batches: Any = 1.0,
    virtual_shards: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The record :class:`ResumeRecord` keeps for ``dataset_length`` rows, from the numbers alone (what an app
    checks a checkpoint against before any rank starts).

    Example::

        >>> expected_record(1438, 2, 1, 32, 42)["batches_per_epoch"]  # ceil(ceil(1438 / 2) / 32)
        23
    """
    record: dict[str, Any] = {"world_size": world_size, "accumulate": accumulate}
    if global_batch_size is not None:
        plan = GlobalPlan(
            dataset_length, global_batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last,
            virtual_shards=virtual_shards,
        )  # fmt: skip
        record["plan"] = plan.state()
        length = plan.steps_per_epoch * accumulate
    else:
        record.update(batch_size=batch_size, seed=seed, shuffle=shuffle, dataset_length=dataset_length)
        length = math.ceil(math.ceil(dataset_length / world_size) / batch_size)
    record["batches_per_epoch"] = _limited(length, limit_train_batches)
    return record


def check_resume(saved: dict[str, Any] | None, now: dict[str, Any], mid_epoch: bool, where: str = "") -> None:
    """Refuse (:class:`ResumeMismatch`) a resume that would train some of the epoch's rows twice or never.

    A planned run continues on any number of ranks with the same plan; a plain loader mid-epoch only with the
    same world size, per-rank batch and seed. ``where`` follows "the middle of an epoch" in the message.

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
        differs = "its data plan differs from this run's"
        advice = (
            "rows would be trained twice or never. Resume with the same global_batch_size, seed, dataset, drop_last"
            " and accumulation (the number of ranks may change)."
        )
    else:
        keys = ("world_size", "batch_size", "seed", "shuffle", "dataset_length", "accumulate")
        changes = [f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in keys if k in saved and saved.get(k) != now.get(k)]
        differs = "this run splits the data differently"
        advice = (
            "its rows would be trained twice or never. Resume with the same ranks, batch size and seed, or train with"
            " a global batch (global_batch_size=G), which resumes on any number of ranks."
        )
    if changes:
        raise ResumeMismatch(
            f"resume: the checkpoint stopped in the middle of an epoch{where} and {differs}"
            f" ({'; '.join(changes)}): {advice}"
        )


def resume_start(
    saved: dict[str, Any] | None, now: dict[str, Any], epoch: int, done: int, last_batch: bool = False,
    in_batch_end: bool = False,
) -> tuple[int, int]:  # fmt: skip
    """Where training starts after a checkpoint restored ``done`` micro-batches into ``epoch``:
    ``(epoch, done)`` to finish that epoch, or ``(epoch + 1, 0)`` when the checkpoint had ended it.

    Whether it had is the checkpoint's own record (its ``batches_per_epoch``, else its plan's, else
    ``last_batch``), never this run's loader; one taken in ``on_train_batch_end`` of its last batch
    (``in_batch_end``) is mid-epoch where ``now`` has more batches. Mid-epoch, :func:`check_resume` decides.

    Example::

        >>> saved = {"world_size": 1, "accumulate": 1, "batch_size": 32, "seed": 0, "batches_per_epoch": 45}
        >>> resume_start(saved, dict(saved), epoch=0, done=38)  # the same split: the epoch goes on
        (0, 38)
        >>> on_two = dict(saved, world_size=2, batches_per_epoch=23)
        >>> resume_start(saved, on_two, epoch=0, done=45)  # its epoch had ended: anything may change
        (1, 0)
        >>> resume_start(saved, on_two, epoch=0, done=38)  # 38 >= 23, and still mid-epoch
        Traceback (most recent call last):
        ...
        ddp_plugins.lightning.data_plan.ResumeMismatch: resume: the checkpoint stopped in the middle of an epoch ...
    """
    if done <= 0:
        return epoch, 0
    per_epoch = _saved_batches_per_epoch(saved)
    ended = last_batch if per_epoch is None else done >= per_epoch
    longer = now.get("batches_per_epoch")
    if ended and in_batch_end and isinstance(longer, int) and done < longer:
        ended = False  # Lightning would go on with this run's later batches of the same epoch
    of = f" of {per_epoch}" if per_epoch is not None else ""
    check_resume(saved, now, mid_epoch=not ended, where=f" (batch {done}{of} of epoch {epoch})")
    return (epoch + 1, 0) if ended else (epoch, done)


def _saved_batches_per_epoch(saved: dict[str, Any] | None) -> int | None:
    """The micro-batches per epoch of the run that wrote a checkpoint record (``None``: not known)."""
    saved = saved or {}
    recorded = saved.get("batches_per_epoch")
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        return recorded
    plan = saved.get("plan")
    if isinstance(plan, dict):
        with contextlib.suppress(TypeError, ValueError):
            return GlobalPlan(**plan).steps_per_epoch * int(saved.get("accumulate", 1))
    return None


def train_loader(
    dataloader: Any, trainer: Any, rank: int, world_size: int, planned: PlannedLoader, uneven: UnevenShards,
    resume: ResumeRecord,
) -> Any:  # fmt: skip
    """The training loader this run trains on (planned, in step across uneven shards, or resumable), the first
    one after a checkpoint was loaded starting where :func:`resume_start` says."""
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
    """A global plan of the training loader's rows (``global_batch_size`` rows a step; ``None``: no plan),
    and the rows of each of its micro-batches."""

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
    """Training loaders whose ranks may yield different numbers of batches, stepped together by
    :class:`~ddp_plugins.core.plan.EvenSteps` (``enabled``): each micro-batch's rows, and the largest flag of
    ``sources`` (this rank's stop flags, contracts.StepAgreement) agreed in the same round."""

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


class PlannedSteps:
    """The default mode's steps: Lightning's, with the rows of a plan or of uneven shards weighting the
    loss and the means logged with ``sync_dist`` (the reproducible mode's: lightning/reproducible.py)."""

    virtual_shards: int | None = None

    def __init__(self) -> None:
        self.rows: BatchRows | None = None  # the micro-batch's, while training_step runs

    def layer_sync(self, plugin: Any) -> Any:
        """The ``LayerSync`` plugin to apply."""
        return plugin

    def before_launch(self, trainer: Any, world_size: int, loader: Any = None, drop_last: bool = False) -> None:
        """Refuse what the steps cannot run, before any rank starts (``loader``: the training loader given to fit)."""

    def setup(self, trainer: Any) -> None:
        """Checks and settings for one fit (undone in ``teardown``)."""

    def teardown(self) -> None:
        """Undo ``setup``."""

    def training_step(
        self, trainer: Any, rows: BatchRows | None, plan: Any, context: Any, step: Callable[[], Any], args: tuple
    ) -> Any:
        """Run ``step`` (Lightning's); an empty micro-batch's NaN mean loss goes into no epoch sum."""
        self.rows = rows
        empty = rows is not None and rows.rank_rows == 0
        try:
            with counts_for_nothing(trainer, "training_step", None) if empty else contextlib.nullcontext():
                return step()
        finally:
            self.rows = None

    def backward(self, loss: Any, module: Any, rows: BatchRows | None, precision: Any, backward: Callable) -> Any:
        """DDP averages the ranks' gradients and Lightning divides by the accumulation: on a plan, each
        micro-batch's mean loss is weighted by its rows instead (0 for an empty one)."""
        if rows is not None and module.automatic_optimization:
            loss = loss * rows.loss_weight
        return backward(loss)

    def reduce(self, tensor: Any, group: Any, reduce_op: Any, reduce: Callable[..., Any]) -> Any:
        """``self.log(..., sync_dist=True)`` of a mean in training_step: the mean over the micro-batch's rows."""
        rows = self.rows
        if rows is None or not is_mean(reduce_op):
            return reduce(tensor, group, reduce_op)
        local = tensor * rows.rank_rows if rows.rank_rows else torch.zeros_like(tensor)  # an empty batch's NaN
        return reduce(local, group, "sum") / rows.micro_rows

    def evaluation_loader(self, dataloader: Any, world_size: int, rank: int) -> Any:
        """Lightning's unshuffled ``DistributedSampler`` (it pads a shard with rows from the start, inside a
        batch) gives way to contiguous shards whose padding rows are batches of their own, which
        :meth:`evaluation_step` counts for nothing: a mean logged with ``sync_dist`` and a torchmetrics
        metric are then over the dataset's rows, and every rank still runs the same number of batches.
        ``SequentialEvaluation`` makes its loaders so itself; a loader that cannot be rebuilt is kept."""
        sampler = getattr(dataloader, "sampler", None)
        if world_size < 2 or type(sampler) is not DistributedSampler or getattr(sampler, "shuffle", True):
            return dataloader  # not Lightning's (a shuffled one too: left as the user asked)
        return padding_apart_loader(dataloader, world_size, rank) or dataloader

    def evaluation_step(self, trainer: Any, hook: str, args: tuple, step: Callable[[], Any]) -> Any:
        """A padding batch (:meth:`evaluation_loader`) runs the user's step, which counts for nothing."""
        if not padding_batch(trainer, args):
            return step()
        with counts_for_nothing(trainer, hook, trainer.lightning_module):
            return step()


def is_mean(reduce_op: Any) -> bool:
    """Whether ``reduce_op`` (``strategy.reduce``'s) names a mean."""
    return isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")


class ResumeRecord:
    """The training data's layout a checkpoint records, and where a run resumed from one starts."""

    def __init__(self) -> None:
        self.record: dict[str, Any] | None = None  # the current training loader's layout
        self._resumed: dict[str, Any] | None = None  # the record of the checkpoint loaded last
        self._restored = False  # a checkpoint was loaded and the training loader not made since
        self.resumed = False  # the current training loader is the first one after a checkpoint was loaded
        self._quiet: tuple[Any, ...] | None = None  # our entry in warnings.filters while a resumed fit runs

    def checkpoint_loaded(self, record: dict[str, Any] | None) -> None:
        """A checkpoint was loaded (``record``: its data record, if any): the next training loader starts there."""
        self._resumed, self._restored = record, True

    def start(self, record: dict[str, Any], length: int | None, trainer: Any) -> tuple[int, int]:
        """Keep a new training loader's ``record`` (``length``: its micro-batches per epoch) and return the
        epoch and micro-batch it starts at (where the checkpoint loaded last stopped, else the epoch's start)."""
        if isinstance(length, int):
            record["batches_per_epoch"] = _limited(length, getattr(trainer, "limit_train_batches", 1.0))
        self.record = record
        restored, self._restored = self._restored, False
        self.resumed = restored
        epoch = trainer.current_epoch  # counters of the epoch before are not reset yet at a reload
        if not restored:
            return epoch, 0
        progress = trainer.fit_loop.epoch_loop.batch_progress
        done = progress.current.processed
        epoch, start = resume_start(
            self._resumed, record, epoch, done, last_batch=progress.is_last_batch,
            in_batch_end=progress.current.completed < done,
        )  # fmt: skip
        # Lightning warns that a mid-epoch resume of a plain DataLoader is unreliable; the loaders
        # built here (a plan, shards in step, a resumable sampler) resume exactly. Silenced for this fit:
        # teardown takes the filter out again (a later fit without the strategy warns as Lightning does).
        if self._quiet is None:
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before")
            self._quiet = warnings.filters[0]
        if (switched := mode_switch(self._resumed, record)) and trainer.is_global_zero:
            log.warning(switched)
        return epoch, start

    def teardown(self) -> None:
        """The fit ended: Lightning's resume warning is no longer silenced (an "ignore" filter records
        nothing in the warning registries, so taking it out is all there is to undo)."""
        if self._quiet is not None:
            with contextlib.suppress(ValueError):  # the user reset the filters meanwhile
                cast("list[Any]", warnings.filters).remove(self._quiet)  # typed a Sequence; a list at run time
            self._quiet = None

    def checkpoint_record(self, module: Any, planned: PlannedLoader) -> dict[str, Any] | None:
        """What a checkpoint stores: the layout with its micro-batches per epoch, and on a plan its epoch and
        the global rows done (only the layout where ``module`` is ``None`` or detached: a spawned fit ended)."""
        if self.record is None:
            return None
        try:
            trainer = module.trainer if module is not None else None
        except RuntimeError:  # detached
            trainer = None
        record = dict(self.record)
        if trainer is None:
            return record
        batches = trainer.num_training_batches  # the loader's, after limit_train_batches
        if isinstance(batches, int):
            record["batches_per_epoch"] = batches
        return dict(record, **planned.position(trainer))


def mode_switch(saved: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """One line when a resume at an epoch's end turns the reproducible mode on or off, or changes
    its ``virtual_shards`` (in the middle of an epoch :func:`check_resume` refuses it); else ``None``.

    Example::

        >>> plan = {"dataset_length": 100, "global_batch_size": 8, "virtual_shards": None}
        >>> mode_switch({"plan": plan}, {"plan": dict(plan, virtual_shards=8)})  # doctest: +ELLIPSIS
        'resume: the checkpoint was trained with reproducible=False and this run goes on with reproducible=True ...'
        >>> mode_switch({"plan": plan}, {"plan": plan}) is None
        True
    """
    before = ((saved or {}).get("plan") or {}).get("virtual_shards")
    after = (now.get("plan") or {}).get("virtual_shards")
    if not saved or before == after:
        return None

    def mode(shards: Any) -> str:
        return f"reproducible=True (virtual_shards={shards})" if shards else "reproducible=False"

    return (
        f"resume: the checkpoint was trained with {mode(before)} and this run goes on with {mode(after)}: its"
        " bits from here on are the same only as those of runs resumed the same way, not of one run in either mode."
    )


def run_accumulation(trainer: Any) -> int:
    """The micro-batches per optimizer step of the whole run (``ArgumentValueError`` where an
    :class:`~ddp_plugins.lightning.contracts.AccumulationSchedule` changes it)."""
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


def _limited(length: int, limit: Any) -> int:
    """The batches of an epoch Lightning trains under ``limit_train_batches`` (a count or a fraction)."""
    if isinstance(limit, int) and not isinstance(limit, bool):
        return min(length, limit)
    return int(length * limit) if isinstance(limit, float) else length


def _agreed_length(dataloader: Any) -> int | None:
    """The longest rank's batch count (``None`` when a rank's loader has no length): one all_reduce."""
    local = sized_len(dataloader)
    local = -1 if local is None else local
    both = torch.tensor([local, -local], dtype=torch.int64, device=collective_device())
    with collective_kind("agreement", "all_reduce"):
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the longest count, and minus the shortest
    return None if int(both[1]) > 0 else int(both[0])


def _resumable_train_loader(dataloader: Any, rank: int, epoch: int, done: int) -> DataLoader | None:
    """The training DataLoader with its sampler in a :class:`ResumableSampler`, its first iteration in ``epoch``
    after ``done`` batches, order and workers' seed from streams of its own (``None``: one that cannot be)."""
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
