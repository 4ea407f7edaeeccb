"""Two traps next door: Lightning's and torch's, met first inside the pack (docs/compatibility.md).

Both fail the same with Lightning's own ``ddp``; the strategy's ``setup`` calls these so that the
user reads one line naming the fix before the failure instead of a trace from deep inside dynamo or
torch's reducer.
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from ddp_plugins import _compat
from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.lightning.contracts import AccumulationSchedule, of_kind

__all__ = ["COMPILED_MODULE_WARNING", "check_static_graph", "warn_compiled_module"]

#: The one line :func:`warn_compiled_module` warns with.
COMPILED_MODULE_WARNING = (
    "ddp_plugins: the LightningModule was compiled whole (`torch.compile(module)` passed to the Trainer),"
    " so dynamo also traces `training_step` and fails inside `self.log`, with Lightning's own `ddp` too;"
    " compile the inner network instead: `self.net = torch.compile(self.net)` in `__init__` or `configure_model`."
)


def warn_compiled_module(module: pl.LightningModule | None) -> bool:
    """Warn in one line, on rank 0, when ``module`` reached the Trainer compiled whole.

    ``Trainer.fit(torch.compile(module))`` (and ``validate``/``test``/``predict``) unwraps the
    ``OptimizedModule`` with ``lightning.pytorch.utilities.compile.from_compiled``, which also wraps
    ``training_step`` and the other step methods in dynamo: the first ``self.log`` then fails in
    dynamo (``InternalTorchDynamoError: AttributeError: 'method' object has no attribute '__dict__'``
    with torch 2.13 and Lightning 2.6.6). A warning, not a refusal: a step that logs nothing may run.

    Returns:
        Whether it warned.

    Example::

        >>> import warnings
        >>> import torch
        >>> from lightning.pytorch.utilities.compile import from_compiled
        >>> warn_compiled_module(pl.LightningModule())
        False
        >>> with warnings.catch_warnings(record=True):
        ...     warn_compiled_module(from_compiled(torch.compile(pl.LightningModule())))
        True
    """
    if not _compat.compiled_by_lightning(module):
        return False
    rank_zero_warn(COMPILED_MODULE_WARNING)
    return True


def check_static_graph(trainer: pl.Trainer) -> None:
    """Refuse, in one line, DDP's ``static_graph=True`` with a fit whose first step accumulates.

    With gradient accumulation (``Trainer(accumulate_grad_batches=K)``, ``AccumulationNoSync`` or
    ``GradientAccumulationScheduler`` at K > 1 in the epoch the fit starts), the first backward after
    DDP wraps the model runs under ``no_sync``; torch's reducer then fails an internal assert
    (``RuntimeError: expect_autograd_hooks_ INTERNAL ASSERT FAILED at ".../reducer.cpp":1732``),
    with Lightning's own ``ddp`` too. A refusal rather than a warning: that run always crashes at its
    first backward (the one exception, an epoch of a single batch, accumulates nothing). A schedule
    that starts at K = 1, such as ``{0: 1, 1: K}``, passes: once DDP has synced one backward, the
    static graph takes ``no_sync``. Read at ``setup``, after the strategy wrapped the model; a fit
    resumed into a later epoch is judged by the schedule's first epoch (Lightning restores the epoch
    after ``setup``).

    Raises:
        ArgumentValueError: DDP's graph is static and the first step accumulates K > 1 micro-batches.

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
    """The micro-batches of the fit's first optimizer step, as far as ``setup`` can tell: the largest of
    ``trainer.accumulate_grad_batches`` and each accumulation schedule's K for the current epoch."""
    epoch = trainer.current_epoch
    found = [int(trainer.accumulate_grad_batches)]
    for callback in of_kind(trainer.callbacks, AccumulationSchedule):  # type: ignore[attr-defined]
        found.append(_scheduled(callback.scheduling, epoch))
    return max(found)


def _scheduled(scheduling: Mapping[int, int], epoch: int) -> int:
    """K of ``epoch`` in ``{epoch: K}``: the value of the largest key not above it (1 before the first)."""
    keys = [key for key in scheduling if key <= epoch]
    return int(scheduling[max(keys)]) if keys else 1
