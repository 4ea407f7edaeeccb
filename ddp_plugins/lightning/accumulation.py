"""Accumulation-aware ``no_sync``; see docs/design.md, "Gradient accumulation and communication"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ddp_plugins.core.checks import ArgumentTypeError, ArgumentValueError
from ddp_plugins.lightning.contracts import AccumulationSchedule, OwnsAccumulationWindow, of_kind

__all__ = ["AccumulationNoSync"]


def is_step_boundary(trainer: pl.Trainer, accumulate_grad_batches: int | None = None) -> bool:
    """Whether the current training batch ends an accumulation window (Lightning's rule, from public counters)."""
    if accumulate_grad_batches is None:
        accumulate_grad_batches = current_accumulation(trainer)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    ready = progress.current.ready  # batches of this epoch so far, this one included
    last = progress.is_last_batch or ready == trainer.num_training_batches
    return ready % accumulate_grad_batches == 0 or (last and not trainer.strategy.handles_gradient_accumulation)


def current_accumulation(trainer: pl.Trainer) -> int:
    """The micro-batches of the current optimizer step: a callback's manual window, else Lightning's."""
    for callback in of_kind(_callbacks(trainer), OwnsAccumulationWindow):
        if callback.manual_window:
            return int(callback.manual_window)
    return int(trainer.accumulate_grad_batches)


def scheduled_factor(scheduling: Mapping[int, int], epoch: int) -> int:
    """K of ``epoch`` in ``{epoch: K}``: the value of the largest key not above it (1 before the first)."""
    keys = [key for key in scheduling if key <= epoch]
    return int(scheduling[max(keys)]) if keys else 1


def _callbacks(trainer: pl.Trainer) -> list[Callback]:
    """``trainer.callbacks``: public, but set by Lightning's callback connector, so not declared on ``Trainer``."""
    return trainer.callbacks  # type: ignore[attr-defined]


class AccumulationNoSync(Callback):
    """Skip the gradient all-reduce on non-boundary micro-batches of gradient accumulation.

    Manual optimization: DDP's ``require_backward_grad_sync`` is off between boundaries (Lightning's
    ``toggle_model`` would flip ``requires_grad``); automatic: K goes to ``trainer.accumulate_grad_batches``.

    Args:
        accumulate_grad_batches: K, a positive int or ``{epoch: K}`` (1 before the first key); with 1 in
            automatic optimization, ``Trainer(accumulate_grad_batches)`` decides.

    Raises:
        ValueError: at ``setup``, if ``Trainer(accumulate_grad_batches)`` or a ``GradientAccumulationScheduler``
            also sets K, or manual optimization runs on a parallel strategy that is not DDP.

    Example::

        >>> import lightning.pytorch as pl
        >>> class Model(pl.LightningModule):
        ...     def training_step(self, batch, batch_idx):
        ...         acc = AccumulationNoSync.of(self.trainer)
        ...         loss = self.compute_loss(batch) / acc.accumulate_grad_batches
        ...         self.manual_backward(loss)  # all-reduces only on boundary batches
        ...         if acc.is_boundary:
        ...             opt = self.optimizers()
        ...             opt.step()
        ...             opt.zero_grad()
        >>> AccumulationNoSync(accumulate_grad_batches={0: 2, 3: 8}).scheduling
        {0: 2, 3: 8}
    """

    def __init__(self, accumulate_grad_batches: int | Mapping[int, int]) -> None:
        super().__init__()
        self.scheduling = _parse_schedule(accumulate_grad_batches)
        self.accumulate_grad_batches = self.scheduling_for(0)
        self.is_boundary = True
        self._manual = False
        self._defer_to_trainer = False
        self._applied_to_trainer: int | None = None

    @classmethod
    def of(cls, trainer: pl.Trainer) -> AccumulationNoSync:
        """The :class:`AccumulationNoSync` callback of ``trainer``, for use inside the LightningModule.

        Raises:
            ValueError: If ``trainer`` has no such callback.
        """
        for callback in _callbacks(trainer):
            if isinstance(callback, cls):
                return callback
        raise ValueError(
            f"`Trainer(callbacks=...)` has no `{cls.__name__}`, got"
            f" {[type(c).__name__ for c in _callbacks(trainer)]}. Add `{cls.__name__}(accumulate_grad_batches=K)`."
        )

    @property
    def manual_window(self) -> int | None:
        """K while this callback runs the accumulation window itself (manual optimization), else ``None``."""
        return self.accumulate_grad_batches if self._manual else None

    def scheduling_for(self, epoch: int) -> int:
        """K for ``epoch``: the value of the largest schedule key not above it (1 before the first key)."""
        return scheduled_factor(self.scheduling, epoch)

    def check_trainer(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The run-dependent checks of ``setup``: clashing accumulation settings, the strategy."""
        schedules = of_kind(_callbacks(trainer), AccumulationSchedule)
        others = [c for c in schedules if not isinstance(c, AccumulationNoSync)]
        if others:
            raise ValueError(
                f"`AccumulationNoSync` and `{type(others[0]).__name__}` both set the accumulation factor."
                f" Remove the `{type(others[0]).__name__}`;"
                " `AccumulationNoSync` takes the same `{epoch: K}` schedule."
            )
        strategy = trainer.strategy
        if pl_module.automatic_optimization:
            if trainer.accumulate_grad_batches not in (1, self._applied_to_trainer) and self.scheduling != {0: 1}:
                ours = self.scheduling[0] if list(self.scheduling) == [0] else self.scheduling
                problem = f"got {ours} with Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})"
                allowed = "1 here when `Trainer(accumulate_grad_batches)` sets K (set it in one place)"
                raise ArgumentValueError("accumulate_grad_batches", allowed, problem=problem)
        elif isinstance(strategy, ParallelStrategy) and not isinstance(strategy, DDPStrategy):
            raise ValueError(
                "`AccumulationNoSync` with manual optimization supports DDP strategies ('ddp', 'ddp_spawn',"
                f" 'ddp_notebook', `DDPStrategy` subclasses) and single-device ones, got {type(strategy).__name__}."
            )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.check_trainer(trainer, pl_module)
        self._manual = not pl_module.automatic_optimization
        # this callback asks for no accumulation (check_trainer refused anything else): the Trainer's K rules
        trainer_sets_k = trainer.accumulate_grad_batches not in (1, self._applied_to_trainer)
        self._defer_to_trainer = trainer_sets_k and not self._manual
        self._start_window(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_window(trainer)

    def _start_window(self, trainer: pl.Trainer) -> None:
        if self._defer_to_trainer:
            self.accumulate_grad_batches = trainer.accumulate_grad_batches
        else:
            self.accumulate_grad_batches = self.scheduling_for(trainer.current_epoch)
            if not self._manual:
                trainer.accumulate_grad_batches = self._applied_to_trainer = self.accumulate_grad_batches

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        k = self.accumulate_grad_batches if self._manual else trainer.accumulate_grad_batches
        self.is_boundary = is_step_boundary(trainer, k)
        ddp = _ddp_model(trainer) if self._manual else None
        if ddp is not None and not self.is_boundary:
            # what `DDP.no_sync()` does: Lightning's `pre_backward` then skips `prepare_for_backward`
            ddp.require_backward_grad_sync = False

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._restore_sync(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_sync(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._applied_to_trainer is not None:
            trainer.accumulate_grad_batches = 1  # so a later `fit` on this Trainer passes the clash check
            self._applied_to_trainer = None

    def _restore_sync(self, trainer: pl.Trainer) -> None:
        ddp = _ddp_model(trainer)
        if self._manual and ddp is not None:
            ddp.require_backward_grad_sync = True


def _ddp_model(trainer: pl.Trainer) -> DistributedDataParallel | None:
    model = trainer.strategy.model
    return model if isinstance(model, DistributedDataParallel) else None


def _parse_schedule(value: Any) -> dict[int, int]:
    def int_from(x: Any, low: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= low

    if int_from(value, 1):
        return {0: value}
    if isinstance(value, Mapping) and value and all(int_from(k, 0) and int_from(v, 1) for k, v in value.items()):
        return dict(sorted((int(k), int(v)) for k, v in value.items()))
    allowed = "a positive int or a non-empty dict {epoch (int >= 0): K (int >= 1)}"
    if isinstance(value, Mapping) or (isinstance(value, int) and not isinstance(value, bool)):
        raise ArgumentValueError("accumulate_grad_batches", allowed, value)
    raise ArgumentTypeError("accumulate_grad_batches", allowed, value)
