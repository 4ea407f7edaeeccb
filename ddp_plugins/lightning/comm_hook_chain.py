"""Communication hooks layered on a strategy's hook, whatever order the callbacks come in.

A callback wraps the strategy's hook in ``setup``, registers it in ``on_fit_start`` and takes its layer
out in ``teardown``; each layer keeps the hook it wraps as ``.hook``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ddp_plugins import _compat

__all__ = ["register_on_model", "unwrap_comm_hook", "wrap_comm_hook"]


def wrap_comm_hook(strategy: DDPStrategy, wrap: Callable[[Any], Any]) -> Any:
    """Replace the strategy's hook ``h`` (``None``: DDP's default) with ``wrap(h)``; return the new hook."""
    hook = wrap(_compat.strategy_comm_hook(strategy))
    _compat.set_strategy_comm_hook(strategy, hook)
    return hook


def register_on_model(strategy: Strategy) -> None:
    """Register the strategy's hook (every layer) on its DDP model when the strategy did not.

    Lightning's ``DDPStrategy`` registers hooks on CUDA only; the first callback to call this
    registers the whole stack of layers, later calls find it registered.
    """
    model, hook = strategy.model, _compat.strategy_comm_hook(strategy)
    if hook is None or not isinstance(model, DistributedDataParallel):
        return
    registers = getattr(type(strategy), "_register_ddp_hooks", None)
    if strategy.root_device.type == "cuda" or registers is not DDPStrategy._register_ddp_hooks:
        # registered by the strategy already: Lightning's on CUDA, an override (ours) on every device.
        # A second `register_comm_hook` fails, and DDP would still list the hook twice.
        return
    state, wrapper = _compat.strategy_comm_state_and_wrapper(strategy)
    try:
        model.register_comm_hook(state, hook if wrapper is None else wrapper(hook))
    except RuntimeError as err:  # registered already, by another layer's callback
        if "only be called once" not in str(err):
            raise


def unwrap_comm_hook(strategy: DDPStrategy, hook: Any, original: Any) -> None:
    """Take the layer ``hook`` out of the strategy's hooks (``original``: what it wrapped when it was made).

    A layer made over ``None`` (DDP's default) holds torch's ``allreduce_hook`` in its place; the
    strategy gets ``None`` back. Layers added inside it since then stay.
    """
    current = _compat.strategy_comm_hook(strategy)
    if current is hook:
        inner = hook.hook
        _compat.set_strategy_comm_hook(strategy, None if original is None and inner is allreduce_hook else inner)
        return
    while current is not None and hasattr(current, "hook"):
        if current.hook is hook:
            current.hook = hook.hook
            return
        current = current.hook
