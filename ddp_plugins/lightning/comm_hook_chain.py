"""Comm-hook layers on a strategy's hook, in the callbacks' ``setup`` order, kept here until it is registered.

See docs/design.md, "Gradient accumulation and communication"."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from ddp_plugins import _compat

__all__ = ["add_comm_hook_layer", "layered", "register_on_model", "remove_comm_hook_layers"]

_layers: weakref.WeakKeyDictionary[Strategy, list[Callable[[Any], Any]]] = weakref.WeakKeyDictionary()


def add_comm_hook_layer(strategy: Strategy, wrap: Callable[[Any], Any]) -> None:
    """Have ``wrap(h)`` registered in place of the hook ``h`` below it (``None``: DDP's default)."""
    _layers.setdefault(strategy, []).append(wrap)


def layered(strategy: Strategy, hook: Any) -> Any:
    """``hook`` (``None``: DDP's default) inside every layer added for ``strategy``, which are then taken."""
    for wrap in _layers.pop(strategy, []):
        hook = wrap(hook)
    return hook


def register_on_model(strategy: Strategy) -> None:
    """Register the layers on the strategy's DDP model, where the strategy neither took them nor registered a hook."""
    model, hook = strategy.model, _compat.strategy_comm_hook(strategy)
    if strategy not in _layers or not isinstance(model, DistributedDataParallel):
        return
    if hook is not None and strategy.root_device.type == "cuda":  # Lightning registered the user's hook
        remove_comm_hook_layers(strategy)
        rank_zero_warn(
            "No comm-hook layer (AllReduceCounter, CommTimeline) on Lightning's `ddp_comm_hook` on CUDA;"
            " DDPPluginsStrategy layers them on it."
        )
        return
    state, wrapper = _compat.strategy_comm_state_and_wrapper(strategy)
    hook = layered(strategy, hook)
    model.register_comm_hook(state, hook if wrapper is None else wrapper(hook))


def remove_comm_hook_layers(strategy: Strategy) -> None:
    """Drop the layers not taken yet (a fit that ended before its model was wrapped)."""
    _layers.pop(strategy, None)
