"""The default mode's step object (:class:`PlannedSteps`), and evaluation padding batches that count for nothing.

See docs/design.md, "One global plan per epoch, and uneven data" and "Exact distributed evaluation"."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics import Metric

from ddp_plugins import _compat
from ddp_plugins._compat import update_dataloader
from ddp_plugins.core.samplers import PaddingApartSampler
from ddp_plugins.lightning.data_plan import BatchRows

__all__ = [
    "PlannedSteps",
    "counts_for_nothing",
    "evaluation_sampler",
    "is_mean",
    "metrics_unchanged",
    "padding_apart_loader",
    "padding_batch",
]


def padding_apart_loader(dataloader: Any, world_size: int, rank: int) -> Any:
    """``dataloader`` on a :class:`PaddingApartSampler`, or ``None`` (unsized, no ``batch_size``, or drop_last)."""
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


def padding_batch(trainer: Any, args: tuple, sampler: Any = None) -> bool:
    """Whether the evaluation step of ``args`` runs a padding batch of a :class:`PaddingApartSampler`."""
    if len(args) < 2 or trainer is None:
        return False
    sampler = evaluation_sampler(trainer, args) if sampler is None else sampler
    return isinstance(sampler, PaddingApartSampler) and sampler.is_padding(int(args[1]))


@contextlib.contextmanager
def metrics_unchanged(module: Any) -> Any:
    """Give every torchmetrics state of ``module`` its value from before the body (torchmetrics cannot undo updates)."""
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
    """What ``hook``'s step logs and updates in the body counts for nothing (an empty micro-batch, a padding batch).
    Lightning has no public way to take a logged value back."""
    results = _compat.running_results(trainer, hook)
    sums = _compat.epoch_sums(results)
    try:
        with metrics_unchanged(module):
            yield
    finally:
        _compat.restore_epoch_sums(results, sums)


class PlannedSteps:
    """The default mode's steps: Lightning's, with a plan's or uneven shards' rows weighting loss and synced means."""

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
        """Weight each micro-batch's mean loss by its rows (0 for an empty one), where DDP and Lightning average."""
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
        """Lightning's unshuffled ``DistributedSampler`` gives way to a ``PaddingApartSampler`` where it can."""
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
