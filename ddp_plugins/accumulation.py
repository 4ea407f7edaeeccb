"""Accumulation-aware no_sync
==========================

With gradient accumulation over K micro-batches, DDP only needs to all-reduce the gradients on
the K-th micro-batch; the others can run forward and backward without synchronization and let
the gradients add up locally (``DistributedDataParallel.no_sync``). Lightning does this in
automatic optimization. In manual optimization every ``manual_backward`` all-reduces,
``Trainer(accumulate_grad_batches=K)`` is refused, and ``LightningOptimizer.toggle_model(
sync_grad=False)`` also flips ``requires_grad`` on the other optimizers' parameters.

* :class:`AccumulationNoSync` (callback): in manual optimization, runs the non-boundary
  micro-batches without gradient synchronization and synchronizes on the boundary ones (every
  K-th batch of an epoch and the epoch's last batch), without touching ``requires_grad``. K may
  be a schedule ``{epoch: K}``. The LightningModule asks ``AccumulationNoSync.of(self.trainer)
  .is_boundary`` to know when to step. In automatic optimization it hands K to Lightning's own
  accumulation (which already uses ``no_sync``), so nothing is done twice.
* :class:`CountingCommHook`: a DDP communication hook that wraps another one (or the default
  all-reduce) and counts the all-reduce calls, rounds and bytes it sends. Usable without
  Lightning: ``ddp_model.register_comm_hook(state, CountingCommHook(hook))``.
* :class:`AllReduceCounter` (callback): installs a :class:`CountingCommHook` around the
  strategy's own hook and logs ``comm/allreduce_calls`` and ``comm/allreduce_bytes`` per optimizer
  step (and their totals), so users see what accumulation with ``no_sync`` saves.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

__all__ = ["AccumulationNoSync", "AllReduceCounter", "CountingCommHook"]


class AccumulationNoSync(Callback):
    """Skip the gradient all-reduce on non-boundary micro-batches of gradient accumulation.

    A batch is a *boundary* when it is the K-th, 2K-th, ... batch of its epoch or the epoch's last
    batch (Lightning's own rule, so a short last window still steps and synchronizes).

    * Manual optimization: on non-boundary batches the DDP model's
      ``require_backward_grad_sync`` is turned off before ``training_step`` (what
      ``DistributedDataParallel.no_sync()`` does), so ``manual_backward`` only accumulates
      locally; on boundary batches it stays on and every ``manual_backward`` all-reduces the
      accumulated gradients. ``requires_grad`` is never changed, so several optimizers (a GAN)
      work without ``toggle_model``. The module steps its optimizers when ``is_boundary`` is
      true. Written by hand because Lightning has no manual-optimization equivalent: its only
      switch, ``toggle_model(sync_grad=False)``, also toggles ``requires_grad``.
    * Automatic optimization: K is handed to Lightning (``trainer.accumulate_grad_batches``, set at
      each epoch start like :class:`~lightning.pytorch.callbacks.GradientAccumulationScheduler`),
      whose loop already runs non-boundary batches under ``no_sync``.

    Args:
        accumulate_grad_batches: micro-batches per optimizer step, a positive int or a schedule
            ``{epoch: K}`` (zero-indexed epochs; epochs before the first key use 1). With 1 (no
            accumulation asked here) in automatic optimization, ``Trainer(accumulate_grad_batches)``
            decides and this callback only reports it.

    Raises:
        ValueError: If ``accumulate_grad_batches`` is not a positive int or a non-empty schedule
            of non-negative int epochs to positive ints; at ``setup`` if
            ``Trainer(accumulate_grad_batches)`` or a ``GradientAccumulationScheduler`` also sets K,
            or if manual optimization runs on a parallel strategy that is not DDP.

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
        for callback in trainer.callbacks:
            if isinstance(callback, cls):
                return callback
        raise ValueError(
            f"`Trainer(callbacks=...)` has no `{cls.__name__}`, got"
            f" {[type(c).__name__ for c in trainer.callbacks]}. Add `{cls.__name__}(accumulate_grad_batches=K)`."
        )

    def scheduling_for(self, epoch: int) -> int:
        """K for ``epoch``: the value of the largest schedule key not above it (1 before the first key)."""
        keys = [key for key in self.scheduling if key <= epoch]
        return self.scheduling[max(keys)] if keys else 1

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        others = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]
        if others:
            raise ValueError(
                "`AccumulationNoSync` and `GradientAccumulationScheduler` both set the accumulation factor."
                " Remove the `GradientAccumulationScheduler`;"
                " `AccumulationNoSync` takes the same `{epoch: K}` schedule."
            )
        self._manual = not pl_module.automatic_optimization
        self._defer_to_trainer = False
        self.accumulate_grad_batches = self.scheduling_for(trainer.current_epoch)
        if self._manual:
            strategy = trainer.strategy
            if isinstance(strategy, ParallelStrategy) and not isinstance(strategy, DDPStrategy):
                raise ValueError(
                    "`AccumulationNoSync` with manual optimization supports DDP strategies ('ddp', 'ddp_spawn',"
                    f" 'ddp_notebook', `DDPStrategy` subclasses) and single-device ones, got {type(strategy).__name__}."
                )
            return
        if trainer.accumulate_grad_batches not in (1, self._applied_to_trainer):
            if self.scheduling == {0: 1}:  # this callback asks for no accumulation: the Trainer's K rules
                self._defer_to_trainer = True
                self.accumulate_grad_batches = trainer.accumulate_grad_batches
                return
            raise ValueError(
                f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` and"
                f" `AccumulationNoSync(accumulate_grad_batches={self._describe()})` both set K."
                " Set it in one place: remove it from the Trainer or remove the callback."
            )
        self._apply_to_trainer(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._defer_to_trainer:
            self.accumulate_grad_batches = trainer.accumulate_grad_batches
            return
        self.accumulate_grad_batches = self.scheduling_for(trainer.current_epoch)
        if not self._manual:
            self._apply_to_trainer(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._manual:
            # exactly the rule Lightning's loop uses to decide between `no_sync` and stepping
            self.is_boundary = not trainer.fit_loop._should_accumulate()
            return
        progress = trainer.fit_loop.epoch_loop.batch_progress
        ready = progress.current.ready  # batches of this epoch so far, this one included
        last = progress.is_last_batch or ready == trainer.num_training_batches
        self.is_boundary = ready % self.accumulate_grad_batches == 0 or last
        ddp = _ddp_model(trainer)
        if ddp is not None and not self.is_boundary:
            # what `DistributedDataParallel.no_sync()` does; Lightning's `pre_backward` then skips
            # `prepare_for_backward`, so the reducer's autograd hooks do not communicate
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

    def _apply_to_trainer(self, trainer: pl.Trainer) -> None:
        trainer.accumulate_grad_batches = self.accumulate_grad_batches
        self._applied_to_trainer = self.accumulate_grad_batches

    def _restore_sync(self, trainer: pl.Trainer) -> None:
        ddp = _ddp_model(trainer)
        if self._manual and ddp is not None:
            ddp.require_backward_grad_sync = True

    def _describe(self) -> Any:
        return self.scheduling[0] if list(self.scheduling) == [0] else self.scheduling


class CountingCommHook:
    """A DDP communication hook that counts what another hook sends, then returns its result.

    ``calls`` and ``bytes`` count every ``torch.distributed.all_reduce`` that the wrapped hook issues
    while it runs, measured on the tensor actually handed to ``all_reduce``: a compression hook
    (``fp16_compress_hook``, or an inner hook wrapped by ``fp16_compress_wrapper``) is counted at
    its compressed size, so the figure is what crossed the wire, not the bucket size. To see those
    calls, ``torch.distributed.all_reduce`` is replaced by a counting pass-through only for the
    duration of the hook call, and only calls from the hook's own thread are counted. Not seen:
    collectives issued in a future's ``then`` callback after the hook returned (PowerSGD's second
    all-reduce), calls made directly on a ``ProcessGroup`` object, and DDP's own bookkeeping
    (unused-parameter map, bucket rebuild, buffer broadcast). ``rounds`` counts synchronized
    backward passes (calls for the last bucket). Written by hand: torch offers no per-hook traffic
    counter.

    Args:
        hook: the hook to wrap, ``hook(state, bucket) -> Future``; ``None`` means DDP's default,
            torch's ``allreduce_hook`` (divide by the world size, all-reduce the bucket).

    Raises:
        TypeError: If ``hook`` is neither ``None`` nor callable.

    Example::

        >>> counter = CountingCommHook()
        >>> counter.calls, counter.bytes, counter.rounds
        (0, 0, 0)
        >>> # ddp_model.register_comm_hook(state=None, hook=counter)
    """

    def __init__(self, hook: Callable[[Any, dist.GradBucket], torch.futures.Future] | None = None) -> None:
        if hook is not None and not callable(hook):
            raise TypeError(f"`hook` should be a DDP communication hook (callable) or None, got {hook!r}.")
        self.hook = hook if hook is not None else allreduce_hook
        inner = getattr(self.hook, "__qualname__", type(self.hook).__name__)
        # DDP and Lightning read these names when registering a hook
        self.__name__ = "counting_comm_hook"
        self.__qualname__ = f"CountingCommHook({inner})"
        self.calls = 0
        self.bytes = 0
        self.rounds = 0

    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]
        # no annotations: DDP compares them with the real classes, and this module's are strings
        with _count_all_reduce(self):
            future = self.hook(state, bucket)
        if bucket.is_last():
            self.rounds += 1
        return future

    def reset(self) -> None:
        """Set every count back to zero."""
        self.calls = self.bytes = self.rounds = 0

    def _record(self, tensor: torch.Tensor) -> None:
        self.calls += 1
        self.bytes += tensor.numel() * tensor.element_size()


class AllReduceCounter(Callback):
    """Count gradient all-reduce calls and bytes per optimizer step and log them.

    In ``setup`` (before the strategy wraps the model in DDP) the strategy's communication hook
    (``DDPStrategy(ddp_comm_hook=...)``, ``None`` for the default all-reduce) is wrapped in a
    :class:`CountingCommHook`; the user's hook, state and wrapper keep working. Lightning's
    ``DDPStrategy`` registers hooks only on CUDA, so in ``on_fit_start`` a DDP model without a
    registered hook gets the counting hook (with the strategy's state and wrapper) registered here.
    At every optimizer step it records what was sent since the previous step and logs
    ``{prefix}/allreduce_calls``, ``{prefix}/allreduce_bytes``, ``{prefix}/allreduce_rounds`` and
    their ``_total`` versions. Totals are also attributes (``calls``, ``bytes``, ``rounds``,
    ``optimizer_steps``) and ``history`` holds one ``(calls, bytes, rounds)`` per optimizer step.

    Args:
        log: log the counts with ``LightningModule.log``.
        prefix: metric name prefix.

    Raises:
        TypeError: If ``log`` is not a bool or ``prefix`` is not a non-empty str.

    Example::

        >>> counter = AllReduceCounter(prefix="comm")
        >>> counter.calls, counter.optimizer_steps
        (0, 0)
        >>> # Trainer(strategy="ddp", accumulate_grad_batches=8, callbacks=[counter])
    """

    def __init__(self, log: bool = True, prefix: str = "comm") -> None:
        super().__init__()
        if not isinstance(log, bool):
            raise TypeError(f"`log` should be True or False, got {log!r}.")
        if not isinstance(prefix, str) or not prefix:
            raise TypeError(f"`prefix` should be a non-empty str, got {prefix!r}.")
        self.log = log
        self.prefix = prefix
        self.hook: CountingCommHook | None = None
        self.optimizer_steps = 0
        self.history: list[tuple[int, int, int]] = []
        self._offset = (0, 0, 0)  # counts restored from a checkpoint
        self._last = (0, 0, 0)
        self._strategy: DDPStrategy | None = None
        self._user_hook: Callable | None = None

    @property
    def calls(self) -> int:
        """All-reduce calls so far."""
        return self._totals()[0]

    @property
    def bytes(self) -> int:
        """Bytes handed to all-reduce so far (per rank)."""
        return self._totals()[1]

    @property
    def rounds(self) -> int:
        """Synchronized backward passes so far."""
        return self._totals()[2]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, DDPStrategy):
            rank_zero_warn(
                f"`AllReduceCounter` counts DDP gradient all-reduces, but the strategy is {type(strategy).__name__};"
                " nothing will be counted."
            )
            return
        if isinstance(strategy._ddp_comm_hook, CountingCommHook):  # already wrapped (another fit)
            self.hook = strategy._ddp_comm_hook
            return
        self._strategy, self._user_hook = strategy, strategy._ddp_comm_hook
        self.hook = CountingCommHook(strategy._ddp_comm_hook)
        self._last = (self.hook.calls, self.hook.bytes, self.hook.rounds)
        strategy._ddp_comm_hook = self.hook

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if self.hook is None or not isinstance(model, DistributedDataParallel) or model._comm_hooks:
            return
        strategy = trainer.strategy
        _register_ddp_comm_hook(
            model=model,
            ddp_comm_state=strategy._ddp_comm_state,
            ddp_comm_hook=self.hook,
            ddp_comm_wrapper=strategy._ddp_comm_wrapper,
        )

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.hook is None:
            return
        now = (self.hook.calls, self.hook.bytes, self.hook.rounds)
        step = tuple(n - last for n, last in zip(now, self._last))
        self._last = now
        self.optimizer_steps += 1
        self.history.append(step)  # type: ignore[arg-type]
        if self.log:
            totals = self._totals()
            for name, value, total in zip(("calls", "bytes", "rounds"), step, totals):
                pl_module.log(f"{self.prefix}/allreduce_{name}", float(value), on_step=True, on_epoch=False)
                pl_module.log(f"{self.prefix}/allreduce_{name}_total", float(total), on_step=True, on_epoch=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._strategy is not None:
            self._strategy._ddp_comm_hook = self._user_hook  # leave the strategy as it was given
            self._strategy = None

    @override
    def state_dict(self) -> dict[str, Any]:
        calls, nbytes, rounds = self._totals()
        return {"calls": calls, "bytes": nbytes, "rounds": rounds, "optimizer_steps": self.optimizer_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        live = (self.hook.calls, self.hook.bytes, self.hook.rounds) if self.hook is not None else (0, 0, 0)
        saved = (state_dict.get("calls", 0), state_dict.get("bytes", 0), state_dict.get("rounds", 0))
        self._offset = tuple(s - n for s, n in zip(saved, live))  # type: ignore[assignment]
        self.optimizer_steps = state_dict.get("optimizer_steps", 0)

    def _totals(self) -> tuple[int, int, int]:
        live = (self.hook.calls, self.hook.bytes, self.hook.rounds) if self.hook is not None else (0, 0, 0)
        return tuple(n + o for n, o in zip(live, self._offset))  # type: ignore[return-value]


_ORIGINAL_ALL_REDUCE = dist.all_reduce
_active = threading.local()
_patch_lock = threading.Lock()
_patch_depth = 0


def _counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    counter = getattr(_active, "counter", None)
    if counter is not None:
        counter._record(tensor)
    return _ORIGINAL_ALL_REDUCE(tensor, *args, **kwargs)


@contextlib.contextmanager
def _count_all_reduce(counter: CountingCommHook) -> Iterator[None]:
    """Route ``torch.distributed.all_reduce`` through ``counter`` for this thread while the body runs."""
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            dist.all_reduce = _counting_all_reduce
        _patch_depth += 1
    previous = getattr(_active, "counter", None)
    _active.counter = counter
    try:
        yield
    finally:
        _active.counter = previous
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                dist.all_reduce = _ORIGINAL_ALL_REDUCE


def _ddp_model(trainer: pl.Trainer) -> DistributedDataParallel | None:
    model = trainer.strategy.model
    return model if isinstance(model, DistributedDataParallel) else None


def _parse_schedule(value: Any) -> dict[int, int]:
    def positive_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    if positive_int(value):
        return {0: value}
    if isinstance(value, Mapping) and value:
        keys_ok = all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in value)
        if keys_ok and all(positive_int(v) for v in value.values()):
            return dict(sorted((int(k), int(v)) for k, v in value.items()))
    raise ValueError(
        "`accumulate_grad_batches` should be a positive int or a non-empty dict {epoch (int >= 0): K (int >= 1)},"
        f" got {value!r}."
    )
