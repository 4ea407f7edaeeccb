"""The data layout a checkpoint records, resumes checked against it, and where one starts.

See docs/design.md, "One global plan per epoch, and uneven data"."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Sized
from typing import TYPE_CHECKING, Any, cast

from torch.utils.data.distributed import DistributedSampler

from ddp_plugins.core.plan import GlobalPlan

if TYPE_CHECKING:
    from ddp_plugins.lightning.data_plan import PlannedLoader

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_KEY",
    "ResumeMismatch",
    "ResumeRecord",
    "check_resume",
    "data_record",
    "expected_record",
    "limited",
    "mode_switch",
    "resume_start",
]

CHECKPOINT_KEY = "ddp_plugins_data"


class ResumeMismatch(ValueError):
    """A checkpoint's data layout that this run cannot continue exactly (one line, names what changed)."""


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
    """The record :class:`ResumeRecord` keeps for ``dataset_length`` rows, from the numbers alone (an app's check).

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
    record["batches_per_epoch"] = limited(length, limit_train_batches)
    return record


def check_resume(saved: dict[str, Any] | None, now: dict[str, Any], mid_epoch: bool, where: str = "") -> None:
    """Refuse (:class:`ResumeMismatch`) a resume that would train some of the epoch's rows twice or never.

    ``where`` follows "the middle of an epoch" in the message.

    Example::

        >>> plan = {"dataset_length": 100, "global_batch_size": 8, "seed": 0, "shuffle": True, "drop_last": False}
        >>> check_resume({"plan": plan, "world_size": 2, "accumulate": 1},
        ...              {"plan": plan, "world_size": 3, "accumulate": 1}, mid_epoch=True)  # another world size: fine
        >>> check_resume({"world_size": 2, "accumulate": 1, "batch_size": 32, "seed": 0},
        ...              {"world_size": 1, "accumulate": 1, "batch_size": 32, "seed": 0}, mid_epoch=True)
        Traceback (most recent call last):
        ...
        ddp_plugins.lightning.resume.ResumeMismatch: resume: the checkpoint stopped in the middle of an epoch ...
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
    """Where training starts after a checkpoint restored ``done`` micro-batches into ``epoch``: ``(epoch, done)``,
    or ``(epoch + 1, 0)`` where the checkpoint's own record (never this run's loader) says it ended the epoch
    (with ``in_batch_end``: not if ``now`` has more batches). Mid-epoch, :func:`check_resume` decides.

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
        ddp_plugins.lightning.resume.ResumeMismatch: resume: the checkpoint stopped in the middle of an epoch ...
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


class ResumeRecord:
    """The training data's layout a checkpoint records, and where a run resumed from one starts."""

    def __init__(self) -> None:
        self.record: dict[str, Any] | None = None  # the current training loader's layout
        self._resumed: dict[str, Any] | None = None  # the record of the checkpoint loaded last
        self._restored = False  # a checkpoint was loaded and the training loader not made since
        self.resumed = False  # the current training loader is the first one after a checkpoint was loaded
        self._quiet: tuple[Any, ...] | None = None  # our warnings.filters entry

    def checkpoint_loaded(self, record: dict[str, Any] | None) -> None:
        """A checkpoint was loaded (``record``: its data record, if any): the next training loader starts there."""
        self._resumed, self._restored = record, True

    def start(self, record: dict[str, Any], length: int | None, trainer: Any) -> tuple[int, int]:
        """Keep a new training loader's ``record`` (``length``: batches per epoch); return its (epoch, batch) start."""
        if isinstance(length, int):
            record["batches_per_epoch"] = limited(length, getattr(trainer, "limit_train_batches", 1.0))
        self.record = record
        self.resumed, self._restored = self._restored, False
        epoch = trainer.current_epoch  # counters of the epoch before are not reset yet at a reload
        if not self.resumed:
            return epoch, 0
        progress = trainer.fit_loop.epoch_loop.batch_progress
        done = progress.current.processed
        epoch, start = resume_start(
            self._resumed, record, epoch, done, last_batch=progress.is_last_batch,
            in_batch_end=progress.current.completed < done,
        )  # fmt: skip
        # Lightning's warning that a mid-epoch resume is unreliable; these loaders resume exactly (until teardown)
        if self._quiet is None:
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before")
            self._quiet = warnings.filters[0]
        if (switched := mode_switch(self._resumed, record)) and trainer.is_global_zero:
            log.warning(switched)
        return epoch, start

    def teardown(self) -> None:
        """Unsilence Lightning's resume warning (an "ignore" filter leaves no registry entry to undo)."""
        if self._quiet is not None:
            with contextlib.suppress(ValueError):  # the user reset the filters meanwhile
                cast("list[Any]", warnings.filters).remove(self._quiet)  # typed a Sequence; a list at run time
            self._quiet = None

    def checkpoint_record(self, module: Any, planned: PlannedLoader) -> dict[str, Any] | None:
        """What a checkpoint stores: the layout, batches per epoch and plan position (the layout alone if detached)."""
        if self.record is None:
            return None
        try:
            trainer = module.trainer if module is not None else None
        except RuntimeError:  # detached
            trainer = None
        record = dict(self.record)
        if trainer is not None:
            batches = trainer.num_training_batches  # the loader's, after limit_train_batches
            if isinstance(batches, int):
                record["batches_per_epoch"] = batches
            record.update(planned.position(trainer))
        return record


def mode_switch(saved: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """One line when a resume at an epoch's end switches the reproducible mode or ``virtual_shards``, else ``None``.

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


def limited(length: int, limit: Any) -> int:
    """The batches of an epoch Lightning trains under ``limit_train_batches`` (a count or a fraction)."""
    if isinstance(limit, int) and not isinstance(limit, bool):
        return min(length, limit)
    return int(length * limit) if isinstance(limit, float) else length
