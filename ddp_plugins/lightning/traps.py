"""Two traps of Lightning's and torch's own ``ddp``, named in one line at setup (docs/compatibility.md)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from ddp_plugins import _compat
from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.lightning.accumulation import scheduled_factor
from ddp_plugins.lightning.contracts import AccumulationSchedule, of_kind

__all__ = ["COMPILED_MODULE_WARNING", "check_static_graph", "warn_compiled_module"]

#: The one line :func:`warn_compiled_module` warns with.
COMPILED_MODULE_WARNING = (
    "ddp_plugins: the LightningModule was compiled whole (`torch.compile(module)` passed to the Trainer),"
    " so dynamo also traces `training_step` and fails inside `self.log`, with Lightning's own `ddp` too;"
    " compile the inner network instead: `self.net = torch.compile(self.net)` in `__init__` or `configure_model`."
)


def warn_compiled_module(module: pl.LightningModule | None) -> bool:
    """Warn in one line, on rank 0, when ``module`` reached the Trainer compiled whole; return whether it warned.

    Example::

        >>> import warnings
        >>> import torch
        >>> from lightning.pytorch.utilities.compile import from_compiled
        >>> warn_compiled_module(pl.LightningModule())
        False
        >>> compiled = from_compiled(torch.compile(pl.LightningModule()))
        >>> with warnings.catch_warnings(record=True):  # where dynamo fails in `self.log` (torch 2.12, 2.13)
        ...     warn_compiled_module(compiled) is _compat.DYNAMO_FAILS_IN_SELF_LOG
        True
    """
    if not (_compat.DYNAMO_FAILS_IN_SELF_LOG and _compat.compiled_by_lightning(module)):
        return False
    rank_zero_warn(COMPILED_MODULE_WARNING)
    return True


def check_static_graph(trainer: pl.Trainer) -> None:
    """Refuse DDP's ``static_graph=True`` when the fit's first step accumulates (torch's reducer would assert).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> check_static_graph(Trainer(accelerator="cpu", accumulate_grad_batches=4, logger=False))  # no DDP: passes
    """
    model = trainer.strategy.model
    if not (isinstance(model, DistributedDataParallel) and model.static_graph):
        return
    accumulate = _first_accumulation(trainer)
    if accumulate > 1:
        raise ArgumentValueError(
            "static_graph",
            "False when the first optimizer step accumulates gradients",
            problem=f"got True with {accumulate} micro-batches per step from the first one",
            hint=(
                "torch's reducer fails an internal assert (`expect_autograd_hooks_`) when DDP's first backward"
                " skips the sync, as with Lightning's own `ddp`. Pass static_graph=False, or start accumulating"
                " after the first epoch (`AccumulationNoSync({0: 1, 1: K})`)."
            ),
        )


def _first_accumulation(trainer: pl.Trainer) -> int:
    """The micro-batches of the fit's first optimizer step, as far as ``setup`` can tell (the largest K)."""
    epoch = trainer.current_epoch
    found = [int(trainer.accumulate_grad_batches)]
    for callback in of_kind(trainer.callbacks, AccumulationSchedule):  # type: ignore[attr-defined]
        found.append(scheduled_factor(callback.scheduling, epoch))
    return max(found)
