"""ddp_plugins: PyTorch Lightning plugins that make DDP training equal single-process math.

The most used names of :mod:`ddp_plugins.core` and :mod:`ddp_plugins.lightning`. An adapter name loads Lightning
on first use; the strategy names (``strategy="ddp_plugins"``, ...) register once Lightning is imported, before or after.
See docs/design.md, "Layout".

Example::

    >>> import ddp_plugins
    >>> ddp_plugins.get_world_size()  # no process group: a single process
    1
    >>> ddp_plugins.SyncBatchNormCallback.__module__  # an adapter, loaded on first access
    'ddp_plugins.lightning.sync_batchnorm'
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import sys
import warnings
from typing import Any

from ddp_plugins.core import (
    CountingCommHook,
    SequentialDistributedSampler,
    SyncBatchNorm,
    Timeline,
    build_comm_hook,
    convert_sync_batchnorm,
    distributed_concat,
    exit_process,
    get_rank,
    get_world_size,
    rank_zero_first,
    revert_sync_batchnorm,
    run_main,
    save_atomic,
    seed_everything_rank_aware,
    setup_rank_logging,
)

__version__ = "0.3.1"

_ADAPTERS = {  # loaded (with Lightning) on first access
    "AccumulationNoSync": "ddp_plugins.lightning.accumulation",
    "AllReduceCounter": "ddp_plugins.lightning.allreduce_counter",
    "CommTimeline": "ddp_plugins.lightning.comm_timeline",
    "DDPPluginsStrategy": "ddp_plugins.lightning.strategy",
    "PreemptionCheckpoint": "ddp_plugins.lightning.preemption",
    "RankAwareSeed": "ddp_plugins.lightning.rank_aware_seed",
    "SequentialEvaluation": "ddp_plugins.lightning.sequential_evaluation",
    "SyncBatchNormCallback": "ddp_plugins.lightning.sync_batchnorm",
    "SyncBatchNormPlugin": "ddp_plugins.lightning.layer_sync",
    "apply_network_env": "ddp_plugins.lightning.network",
}

__all__ = [
    *_ADAPTERS,
    "CountingCommHook",
    "SequentialDistributedSampler",
    "SyncBatchNorm",
    "Timeline",
    "build_comm_hook",
    "convert_sync_batchnorm",
    "distributed_concat",
    "exit_process",
    "get_rank",
    "get_world_size",
    "rank_zero_first",
    "revert_sync_batchnorm",
    "run_main",
    "save_atomic",
    "seed_everything_rank_aware",
    "setup_rank_logging",
]


def __getattr__(name: str) -> Any:
    if name in _ADAPTERS:
        value = getattr(importlib.import_module(_ADAPTERS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ADAPTERS))


_LIGHTNING = "lightning.pytorch"  # its import ends with Lightning's StrategyRegistry filled


def _register_strategy_names() -> None:
    """The strategy's module registers its names in Lightning's ``StrategyRegistry`` when imported."""
    try:
        importlib.import_module("ddp_plugins.lightning.strategy")
    except Exception as error:  # noqa: BLE001 - a user's `import lightning` must not fail for our names
        warnings.warn(f"ddp_plugins: the strategy names are not registered with Lightning ({error!r})", stacklevel=2)


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Registers the strategy names once ``lightning.pytorch`` has been imported, whoever imports it.

    By hand: Lightning reads no entry points for strategy names, and the core must not import Lightning early.
    It finds nothing itself: it wraps the other finders' spec of that one module."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _LIGHTNING:
            return None
        finders = [finder for finder in sys.meta_path if finder is not self and hasattr(finder, "find_spec")]
        spec = next(filter(None, (finder.find_spec(fullname, path, target) for finder in finders)), None)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: Any) -> None:  # this spec's loader only (a loader is made per spec)
            execute(module)
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
            if "ddp_plugins.lightning" not in sys.modules:  # else the layer's own import registers them
                _register_strategy_names()

        loader.exec_module = exec_module
        return spec


if _LIGHTNING in sys.modules:
    _register_strategy_names()
elif not any(isinstance(finder, _RegisterAfterLightning) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterLightning())
