"""The Lightning adapters
======================

Callbacks, plugins and the DDP strategy, each wiring a part of :mod:`ddp_plugins.core` into a ``Trainer``.
Importing the package registers ``ddp_plugins``, ``ddp_plugins_spawn`` and ``ddp_plugins_notebook``.

Example::

    >>> from lightning.pytorch.strategies import StrategyRegistry
    >>> sorted(name for name in StrategyRegistry.available_strategies() if name.startswith("ddp_plugins"))
    ['ddp_plugins', 'ddp_plugins_notebook', 'ddp_plugins_spawn']
"""

from ddp_plugins.lightning.accumulation import AccumulationNoSync
from ddp_plugins.lightning.allreduce_counter import AllReduceCounter
from ddp_plugins.lightning.checkpoint_io import AtomicCheckpointIO
from ddp_plugins.lightning.comm_timeline import CommTimeline
from ddp_plugins.lightning.csv_logger import ResumableCSVLogger
from ddp_plugins.lightning.layer_sync import SyncBatchNormPlugin
from ddp_plugins.lightning.network import apply_network_env
from ddp_plugins.lightning.preemption import PreemptionCheckpoint
from ddp_plugins.lightning.rank_aware_seed import RankAwareSeed
from ddp_plugins.lightning.safe_loading import UnsafeCheckpointError, safe_loading
from ddp_plugins.lightning.sequential_evaluation import SequentialEvaluation
from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from ddp_plugins.lightning.sync_batchnorm import SyncBatchNormCallback
from ddp_plugins.lightning.tensorboard_logger import ResumableTensorBoardLogger

__all__ = [
    "AccumulationNoSync",
    "AllReduceCounter",
    "AtomicCheckpointIO",
    "CommTimeline",
    "DDPPluginsStrategy",
    "PreemptionCheckpoint",
    "RankAwareSeed",
    "ResumableCSVLogger",
    "ResumableTensorBoardLogger",
    "SequentialEvaluation",
    "SyncBatchNormCallback",
    "SyncBatchNormPlugin",
    "UnsafeCheckpointError",
    "apply_network_env",
    "safe_loading",
]
