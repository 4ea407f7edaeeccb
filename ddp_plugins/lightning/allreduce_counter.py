"""A callback that logs the gradient all-reduce calls and bytes of every optimizer step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from ddp_plugins.core.checks import ArgumentTypeError, ArgumentValueError, check_bool
from ddp_plugins.core.comm_hooks import CountingCommHook
from ddp_plugins.lightning._loggers import log_to_loggers
from ddp_plugins.lightning.comm_hook_chain import add_comm_hook_layer, register_on_model, remove_comm_hook_layers

__all__ = ["AllReduceCounter"]


def _minus(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int]:
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2])


class AllReduceCounter(Callback):
    """Count gradient all-reduce calls and bytes per optimizer step and log them.

    Wraps the strategy's hook in a :class:`CountingCommHook`: logs ``{prefix}/allreduce_calls``, ``_bytes``, ``_rounds``
    (and ``_total``); ``history`` holds them per step. Under a CUDA ``ddp_comm_hook``: ``DDPPluginsStrategy`` only.

    Example::

        >>> counter = AllReduceCounter(prefix="comm")
        >>> counter.calls, counter.optimizer_steps
        (0, 0)
        >>> # Trainer(strategy="ddp", accumulate_grad_batches=8, callbacks=[counter])
    """

    def __init__(self, log: bool = True, prefix: str = "comm") -> None:
        super().__init__()
        # not `self.log`: Lightning sets every callback's `log` to the module's at fit start
        self.log_metrics = check_bool("log", log)
        if not isinstance(prefix, str):
            raise ArgumentTypeError("prefix", "a non-empty str", prefix)
        if not prefix:
            raise ArgumentValueError("prefix", "a non-empty str", prefix)
        self.prefix = prefix
        self.hook: CountingCommHook | None = None
        self.optimizer_steps = 0
        self.history: list[tuple[int, int, int]] = []
        self._behind = (0, 0, 0)  # the live counts minus a restored checkpoint's
        self._last = (0, 0, 0)
        self._strategy: DDPStrategy | None = None

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
        self._strategy = strategy
        self.hook, self._last = None, (0, 0, 0)
        add_comm_hook_layer(strategy, self._counting)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._strategy is not None:
            register_on_model(self._strategy)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.hook is None:
            return
        now = self._live()
        step = _minus(now, self._last)
        self._last = now
        self.optimizer_steps += 1
        self.history.append(step)
        if self.log_metrics and self._logs_now(trainer):
            metrics = {}
            for name, value, total in zip(("calls", "bytes", "rounds"), step, self._totals(), strict=True):
                metrics[f"{self.prefix}/allreduce_{name}"] = float(value)
                metrics[f"{self.prefix}/allreduce_{name}_total"] = float(total)
            log_to_loggers(trainer, metrics)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._strategy is not None:
            remove_comm_hook_layers(self._strategy)
            self._strategy = None

    @override
    def state_dict(self) -> dict[str, Any]:
        calls, nbytes, rounds = self._totals()
        return {"calls": calls, "bytes": nbytes, "rounds": rounds, "optimizer_steps": self.optimizer_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = (state_dict.get("calls", 0), state_dict.get("bytes", 0), state_dict.get("rounds", 0))
        self._behind = _minus(self._live(), saved)
        self.optimizer_steps = state_dict.get("optimizer_steps", 0)

    def _counting(self, hook: Any) -> CountingCommHook:
        self.hook = CountingCommHook(hook)
        return self.hook

    def _logs_now(self, trainer: pl.Trainer) -> bool:
        """Whether the Trainer's loggers write step metrics now (every ``log_every_n_steps``, at an epoch's end)."""
        every = int(getattr(trainer, "log_every_n_steps", 1))  # set on the Trainer by its logger connector
        if every <= 0:  # the loggers never write step metrics
            return False
        step = trainer.global_step + 1  # this optimizer step, counted as the loggers count (resumes included)
        last_step = trainer.max_steps > 0 and step >= trainer.max_steps
        return step % every == 0 or trainer.is_last_batch or last_step

    def _live(self) -> tuple[int, int, int]:
        hook = self.hook
        return (hook.calls, hook.bytes, hook.rounds) if hook is not None else (0, 0, 0)

    def _totals(self) -> tuple[int, int, int]:
        return _minus(self._live(), self._behind)
