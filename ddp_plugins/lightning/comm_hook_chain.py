"""Communication hooks layered on a strategy's hook, in the order of the callbacks' ``setup``.

Each layer is built once around the hook the strategy holds at that callback's ``setup`` (the user's,
or the previous callback's layer); ``teardown`` gives the strategy back the hook it held before."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.nn.parallel import DistributedDataParallel

from ddp_plugins import _compat

__all__ = ["add_comm_hook_layer", "register_on_model", "remove_comm_hook_layers"]

_before: weakref.WeakKeyDictionary[Strategy, Any] = weakref.WeakKeyDictionary()  # its hook before the layers
_registered: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()  # models registered by this module


def add_comm_hook_layer(strategy: DDPStrategy, wrap: Callable[[Any], Any]) -> Any:
    """Give the strategy ``wrap(h)`` as its hook, ``h`` the one it holds (``None``: DDP's default); return it."""
    hook = _compat.strategy_comm_hook(strategy)
    _before.setdefault(strategy, hook)
    layer = wrap(hook)
    _compat.set_strategy_comm_hook(strategy, layer)
    return layer


def register_on_model(strategy: Strategy) -> None:
    """Register the strategy's hook (every layer) on its DDP model when the strategy did not.

    Lightning's ``DDPStrategy`` registers hooks on CUDA only; the first call registers the whole
    stack of layers, later calls find it registered.
    """
    model, hook = strategy.model, _compat.strategy_comm_hook(strategy)
    if hook is None or not isinstance(model, DistributedDataParallel) or model in _registered:
        return
    registers = getattr(type(strategy), "_register_ddp_hooks", None)
    if strategy.root_device.type == "cuda" or registers is not DDPStrategy._register_ddp_hooks:
        return  # registered by the strategy already: Lightning's on CUDA, an override (ours) on every device
    state, wrapper = _compat.strategy_comm_state_and_wrapper(strategy)
    model.register_comm_hook(state, hook if wrapper is None else wrapper(hook))
    _registered.add(model)


def remove_comm_hook_layers(strategy: Strategy) -> None:
    """Give the strategy back the hook it held before the first layer (every layer goes at once)."""
    if strategy in _before:
        _compat.set_strategy_comm_hook(strategy, _before.pop(strategy))
