"""The pack's one rank lookup, rank-aware logging, and the one rule for where a collective's tensors go."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "collective_device",
    "for_collective",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "rank_zero_first",
    "setup_rank_logging",
]

_RANK_HANDLER = "ddp_plugins.rank"  # the name of the handler this module installs


def is_distributed() -> bool:
    """Whether a default process group is up (torch built with distributed support, and initialized).

    Example::

        >>> is_distributed()
        False
    """
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """The global rank: the process group's, else what the launcher put in the environment, else 0.

    Before the process group starts: ``RANK``, ``SLURM_PROCID`` or ``JSM_NAMESPACE_RANK``, else
    ``LOCAL_RANK`` and ``NODE_RANK`` (all Lightning's child ranks get) with ``LOCAL_WORLD_SIZE``.

    Example::

        >>> get_rank()
        0
    """
    if is_distributed():
        return dist.get_rank()
    for key in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")) or 0)
    return local + node * int(os.environ.get("LOCAL_WORLD_SIZE", str(local + 1)))


def get_world_size() -> int:
    """The world size, 1 when no process group is initialized.

    Example::

        >>> get_world_size()
        1
    """
    return dist.get_world_size() if is_distributed() else 1


def collective_device(group: Any = None) -> torch.device:
    """The device whose tensors the group's backend takes: the rank's CUDA device for nccl, else the CPU.

    Where the pack's own tensors go before a collective; a per-device backend such as ``cpu:gloo,cuda:nccl`` has nccl.

    Example::

        >>> collective_device()
        device(type='cpu')
    """
    if is_distributed() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def for_collective(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``tensor`` where the group's backend takes it: unchanged when it already does, else moved.

    gloo takes CUDA tensors too, nccl only those. The caller moves the result back with ``.to(tensor.device)``.

    Example::

        >>> for_collective(torch.ones(2)).device
        device(type='cpu')
    """
    if not is_distributed():
        return tensor
    backends = str(dist.get_backend(group)).lower()
    if tensor.is_cuda and ("nccl" in backends or "gloo" in backends):
        return tensor
    return tensor.to(collective_device(group))  # the same tensor when it is there already


@contextlib.contextmanager
def rank_zero_first(timeout: float | None = None) -> Iterator[None]:
    """Run the body on rank 0 first while the other ranks wait (to prepare a data cache, say), then on the others.

    Args:
        timeout: seconds a rank waits at each barrier before it raises; ``None``: the group's timeout.

    Example::

        >>> with rank_zero_first():
        ...     prepared = True
        >>> prepared
        True
    """
    rank, several = get_rank(), get_world_size() > 1
    barrier: Callable[[], Any] = dist.barrier
    if several and timeout is not None and dist.get_backend() == "gloo":  # gloo supports a bounded barrier
        barrier = functools.partial(dist.monitored_barrier, timeout=timedelta(seconds=timeout))
    if several and rank != 0:
        barrier()
    yield
    if several and rank == 0:
        barrier()


def setup_rank_logging(
    name: str | None = "ddp_plugins",
    level: int = logging.INFO,
    other_ranks_level: int = logging.WARNING,
    fmt: str = "[rank %(rank)s] %(levelname)s %(name)s: %(message)s",
) -> logging.Logger:
    """Log ``level`` and above on rank 0 and ``other_ranks_level`` and above on the other ranks.

    Adds (or replaces) one stderr handler on the logger ``name`` (``None``: the root logger); the rank is read
    per record, so it is right before and after the process group starts.

    Example::

        >>> import sys
        >>> logger = setup_rank_logging("example", fmt="%(levelname)s rank %(rank)s: %(message)s")
        >>> logger.handlers[-1].stream = sys.stdout  # the handler this call added
        >>> logger.info("shown on rank 0 only")
        INFO rank 0: shown on rank 0 only
    """
    logger = logging.getLogger(name)
    for handler in [h for h in logger.handlers if h.get_name() == _RANK_HANDLER]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.set_name(_RANK_HANDLER)  # found again (and replaced) by a later call
    handler.setFormatter(logging.Formatter(fmt))

    def rank_filter(record: logging.LogRecord) -> bool:
        rank = get_rank()
        record.__dict__["rank"] = rank  # what `extra={"rank": ...}` would set: read as %(rank)s
        return record.levelno >= (level if rank == 0 else other_ranks_level)

    handler.addFilter(rank_filter)
    logger.addHandler(handler)
    logger.setLevel(min(level, other_ranks_level))
    if name is not None:
        logger.propagate = False  # one line per record, even when the root logger has handlers
    return logger
