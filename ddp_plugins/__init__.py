"""ddp_plugins: PyTorch Lightning plugins that make DDP training equal single-process math.

The most used names of :mod:`ddp_plugins.core` (plain torch) and :mod:`ddp_plugins.lightning` (the
Lightning adapters); ``import ddp_plugins`` does not import Lightning: an adapter name loads it on
first use. ``docs/design.md`` maps the modules and follows a command line to the DDP call.

Example::

    >>> import ddp_plugins
    >>> ddp_plugins.get_world_size()  # no process group: a single process
    1
    >>> ddp_plugins.SyncBatchNormCallback.__module__  # an adapter, loaded on first access
    'ddp_plugins.lightning.sync_batchnorm'
"""

from __future__ import annotations

import importlib
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

# Adapter names, loaded (with Lightning) on first access.
_ADAPTERS = {
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
