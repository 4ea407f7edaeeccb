"""Ranks and rank-aware logging
=============================

The one rank lookup of the pack (:func:`get_rank`, before and after the process group starts),
:func:`get_world_size`, :func:`rank_zero_first`, :func:`setup_rank_logging`, and the one rule for
where a collective's tensors go (:func:`collective_device`, :func:`for_collective`). Plain torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
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


def is_distributed() -> bool:
    """Whether a default process group is up (torch built with distributed support, and initialized).

    Example::

        >>> is_distributed()
        False
    """
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """The global rank: the process group's, else what the launcher put in the environment, else 0.

    Before the process group starts, the rank comes from ``RANK`` (torchrun, Lightning's
    spawners), ``SLURM_PROCID`` or ``JSM_NAMESPACE_RANK``; Lightning's own child ranks get only
    ``LOCAL_RANK`` and ``NODE_RANK``, which give the global rank on node 0 and, elsewhere, with
    ``LOCAL_WORLD_SIZE``. Without any of those the process is rank 0.

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


def _backends(group: Any = None) -> str:
    """The group's backend name: ``nccl``, ``gloo``, or a per-device spec such as ``cpu:gloo,cuda:nccl``."""
    return str(dist.get_backend(group)).lower()


def collective_device(group: Any = None) -> torch.device:
    """The device whose tensors the group's backend takes: the rank's CUDA device for nccl, else the CPU.

    The one rule of the pack for where a tensor of its own making goes before a collective (stop
    flags, plan counts, clock stamps, gathers). A group that has nccl (``nccl``, or a per-device
    backend such as ``cpu:gloo,cuda:nccl``) runs on ``cuda:<current device>``; gloo, mpi and any
    other backend on the CPU, which every backend takes. Without a process group: the CPU.

    Example::

        >>> collective_device()
        device(type='cpu')
    """
    if is_distributed() and "nccl" in _backends(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def for_collective(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``tensor`` where the group's backend takes it: unchanged when it already does, else moved.

    nccl takes CUDA tensors only (moved to :func:`collective_device`); gloo takes CPU and CUDA
    tensors (a caller's CUDA tensor stays put); other backends take CPU tensors. The caller moves the
    result back with ``.to(tensor.device)`` where it hands it on: results come back where they were.

    Example::

        >>> for_collective(torch.ones(2)).device
        device(type='cpu')
    """
    if not is_distributed():
        return tensor
    backends = _backends(group)
    if tensor.is_cuda and ("nccl" in backends or "gloo" in backends):
        return tensor
    target = collective_device(group)
    return tensor if tensor.device == target else tensor.to(target)


@contextlib.contextmanager
def rank_zero_first(timeout: float | None = None) -> Iterator[None]:
    """Run the body on rank 0 first while the other ranks wait, then on the others.

    Use it for work that must happen once before the others read it, such as preparing a data
    cache. Without a process group it simply runs the body.

    Args:
        timeout: seconds to wait at each barrier; ``None`` uses the process group's timeout.
            A rank that waits longer raises instead of hanging.

    Example::

        >>> with rank_zero_first():
        ...     prepared = True
        >>> prepared
        True
    """
    if get_world_size() == 1:
        yield
        return

    def barrier() -> None:
        if timeout is None or dist.get_backend() != "gloo":
            dist.barrier()
        else:  # gloo supports a bounded barrier
            dist.monitored_barrier(timeout=timedelta(seconds=timeout))

    rank = get_rank()
    if rank != 0:
        barrier()
    yield
    if rank == 0:
        barrier()


class _RankFilter(logging.Filter):
    """Adds ``record.rank``; passes ``level`` and above on rank 0, ``other_level`` and above elsewhere."""

    def __init__(self, level: int, other_level: int) -> None:
        super().__init__()
        self.level, self.other_level = level, other_level

    def filter(self, record: logging.LogRecord) -> bool:
        rank = get_rank()
        record.__dict__["rank"] = rank  # what `extra={"rank": ...}` would set: read as %(rank)s
        return record.levelno >= (self.level if rank == 0 else self.other_level)


def setup_rank_logging(
    name: str | None = "ddp_plugins",
    level: int = logging.INFO,
    other_ranks_level: int = logging.WARNING,
    fmt: str = "[rank %(rank)s] %(levelname)s %(name)s: %(message)s",
) -> logging.Logger:
    """Log ``level`` and above on rank 0 and ``other_ranks_level`` and above on the other ranks.

    Adds one stderr handler to the logger ``name`` (``None``: the root logger) whose lines start
    with the rank. The rank is read when a record is emitted, so it is right whether this is called
    before or after the process group starts. Calling it again replaces the handler.

    Returns:
        The configured logger.

    Example::

        >>> import sys
        >>> logger = setup_rank_logging("example", fmt="%(levelname)s rank %(rank)s: %(message)s")
        >>> logger.handlers[-1].stream = sys.stdout  # the handler this call added
        >>> logger.info("shown on rank 0 only")
        INFO rank 0: shown on rank 0 only
    """
    logger = logging.getLogger(name)
    for handler in [h for h in logger.handlers if getattr(h, "_ddp_plugins_rank_handler", False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler()
    handler._ddp_plugins_rank_handler = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(fmt))
    handler.addFilter(_RankFilter(level, other_ranks_level))
    logger.addHandler(handler)
    logger.setLevel(min(level, other_ranks_level))
    if name is not None:
        logger.propagate = False  # one line per record, even when the root logger has handlers
    return logger
