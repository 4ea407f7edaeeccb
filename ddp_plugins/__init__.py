"""ddp_plugins: PyTorch Lightning plugins that make DDP training equal single-process math."""

from ddp_plugins.distributed import exit_process, get_rank, get_world_size, rank_zero_first, run_main

__version__ = "0.1.0"

__all__ = [
    "exit_process",
    "get_rank",
    "get_world_size",
    "rank_zero_first",
    "run_main",
]
