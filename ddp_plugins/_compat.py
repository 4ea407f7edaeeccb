"""Private Lightning and torch names
=================================

Every name the pack uses that Lightning or torch offer only under a private name, checked against
torch 2.13.0 and Lightning 2.6.1 (the floor in ``pyproject.toml``) to 2.6.6 (``requirements.lock``);
``tests/test_compat.py`` fails when an installed version drops one. Why each is needed:
``docs/design.md``.
"""

from __future__ import annotations

from typing import Any

from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNormFunction
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

__all__ = [
    "CHECKED",
    "BatchNormBase",
    "TorchSyncBatchNormFunction",
    "basic_subprocess_cmd",
    "combined_loader_mode",
    "default_store",
    "explicit_trainer_plugins",
    "loop_data_source",
    "set_num_threads_if_needed",
    "set_strategy_comm_hook",
    "strategy_comm_hook",
    "strategy_comm_state_and_wrapper",
    "update_dataloader",
]

# (module, attribute path) of every private name used, for tests/test_compat.py.
CHECKED: tuple[tuple[str, str], ...] = (
    ("torch.nn.modules._functions", "SyncBatchNorm"),
    ("torch.nn.modules.batchnorm", "_BatchNorm"),
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher.get_extra_results"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher.update_main_process_results"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher._wrapping_function"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher._call_children_scripts"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher._check_can_spawn_children"),
    ("lightning.fabric.strategies.launchers.subprocess_script", "_basic_subprocess_cmd"),
    ("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed"),
    ("lightning.pytorch.utilities.data", "_update_dataloader"),
    ("lightning.pytorch.strategies.ddp", "DDPStrategy._configure_launcher"),
    ("lightning.pytorch.strategies.ddp", "DDPStrategy._register_ddp_hooks"),
    ("lightning.pytorch.strategies.ddp", "DDPStrategy._get_process_group_backend"),
    ("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector.__init__"),
)

_LAZY = {
    "MultiProcessingLauncher": ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher"),
    "SubprocessScriptLauncher": (
        "lightning.pytorch.strategies.launchers.subprocess_script",
        "_SubprocessScriptLauncher",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_store() -> Any:
    """The default process group's store (``torch.distributed.distributed_c10d._get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def basic_subprocess_cmd() -> Any:
    """Lightning's command that re-runs the current script for a child rank."""
    from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd

    return _basic_subprocess_cmd()


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's default of ``OMP_NUM_THREADS`` per process when several share a machine."""
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    _set_num_threads_if_needed(num_processes=num_processes)


def update_dataloader(dataloader: Any, sampler: Any) -> Any:
    """``dataloader`` rebuilt with ``sampler`` (every other argument kept), as Lightning does it.

    Example::

        >>> from torch.utils.data import DataLoader, SequentialSampler
        >>> data = list(range(10))
        >>> loader = update_dataloader(DataLoader(data, batch_size=4), SequentialSampler(data[:6]))
        >>> loader.batch_size, [batch.tolist() for batch in loader]
        (4, [[0, 1, 2, 3], [4, 5]])
    """
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler)


def loop_data_source(loop: Any) -> Any:
    """The object an evaluation or prediction loop asks for its dataloaders (``.dataloader()``)."""
    return loop._data_source


def combined_loader_mode(combined: Any) -> str:
    """The mode of a ``CombinedLoader`` ("sequential", "max_size_cycle", ...).

    Example::

        >>> from lightning.pytorch.utilities import CombinedLoader
        >>> combined_loader_mode(CombinedLoader([[1, 2], [3]], mode="sequential"))
        'sequential'
    """
    return str(combined._mode)


def strategy_comm_hook(strategy: Any) -> Any:
    """The communication hook a ``DDPStrategy`` was given (``None``: DDP's default all-reduce)."""
    return strategy._ddp_comm_hook


def set_strategy_comm_hook(strategy: Any, hook: Any) -> None:
    """Replace the hook a ``DDPStrategy`` will register when it wraps the model."""
    strategy._ddp_comm_hook = hook


def strategy_comm_state_and_wrapper(strategy: Any) -> tuple[Any, Any]:
    """The hook state and hook wrapper a ``DDPStrategy`` was given."""
    return strategy._ddp_comm_state, strategy._ddp_comm_wrapper


def explicit_trainer_plugins() -> list[Any]:
    """The plugins the user passed to the ``Trainer`` being built (empty outside its construction).

    Read from the frame of ``_AcceleratorConnector.__init__`` on the call stack: the connector
    does not keep its ``plugins`` argument.

    Example::

        >>> explicit_trainer_plugins()
        []
    """
    import sys

    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _AcceleratorConnector.__init__.__code__:
            plugins = frame.f_locals.get("plugins")
            if plugins is None:
                return []
            return list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        frame = frame.f_back  # type: ignore[assignment]
    return []
