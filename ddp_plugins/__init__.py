"""ddp_plugins: PyTorch Lightning plugins that make DDP training equal single-process math."""

from ddp_plugins.accumulation import AccumulationNoSync, AllReduceCounter, CountingCommHook
from ddp_plugins.distributed import (
    exit_process,
    get_rank,
    get_world_size,
    rank_zero_first,
    run_main,
    setup_rank_logging,
)
from ddp_plugins.seeding import RankAwareSeed, seed_everything_rank_aware
from ddp_plugins.sync_batchnorm import (
    SyncBatchNorm,
    SyncBatchNormCallback,
    SyncBatchNormPlugin,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from ddp_plugins.evaluation import SequentialDistributedSampler, SequentialEvaluation, distributed_concat
from ddp_plugins.strategy import DDPPluginsStrategy, apply_network_env, build_comm_hook

__version__ = "0.1.0"

__all__ = [
    "AccumulationNoSync",
    "AllReduceCounter",
    "CountingCommHook",
    "exit_process",
    "get_rank",
    "get_world_size",
    "rank_zero_first",
    "run_main",
    "setup_rank_logging",
    "RankAwareSeed",
    "seed_everything_rank_aware",
    "SyncBatchNorm",
    "SyncBatchNormCallback",
    "SyncBatchNormPlugin",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "SequentialDistributedSampler",
    "SequentialEvaluation",
    "distributed_concat",
    "DDPPluginsStrategy",
    "apply_network_env",
    "build_comm_hook",
]
