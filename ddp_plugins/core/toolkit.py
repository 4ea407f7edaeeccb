"""Toolkit for multi-process runs on one machine
=============================================

A free port, the loopback environment and :func:`spawn`, which runs a function on ``N`` gloo ranks
on this machine: what the tests, benchmarks and notebooks use. Plain torch.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_plugins.core.checks import check_int, check_number
from ddp_plugins.core.process import exit_process

__all__ = ["LOOPBACK_ENV", "free_port", "loopback_env", "spawn"]

#: gloo over loopback, one thread per rank: the environment of every local test and benchmark run.
LOOPBACK_ENV = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now.

    Example::

        >>> 1024 <= free_port() <= 65535
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loopback_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: ``os.environ``) pinned to loopback gloo and one thread per rank, plus ``extra``.

    Launcher variables (ranks, world size, port) are dropped unless given in ``extra``, so a child
    process never inherits the ranks of the process that started it.

    Example::

        >>> env = loopback_env({"RANK": "3", "PATH": "/bin"}, MASTER_PORT="1234")
        >>> env["MASTER_ADDR"], env["MASTER_PORT"], "RANK" in env
        ('127.0.0.1', '1234', False)
    """
    env = {**(os.environ if base is None else base), **LOOPBACK_ENV, **extra}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        if key not in extra:
            env.pop(key, None)
    return env


def _rank_main(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, pg_timeout: float, args: tuple, out: Any
) -> None:
    os.environ.update(LOOPBACK_ENV, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        out.put((rank, fn(rank, world_size, *args)))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        out.put((rank, exc))
        code = 1
    exit_process(code)  # no interpreter finalization: no gloo abort at exit


def spawn(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 120.0, pg_timeout: float = 60.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks on 127.0.0.1.

    ``fn`` must be importable (a module-level function) and return something picklable. Returns
    the results ordered by rank. Every rank leaves through :func:`exit_process`.

    Raises:
        RuntimeError: a rank raised (its exception is chained) or died.
        TimeoutError: the ranks did not all finish within ``timeout`` seconds (all are killed).

    Example::

        >>> # def world(rank, world_size): return torch.distributed.get_world_size()  (in a module)
        >>> # spawn(world, world_size=2) -> [2, 2], ordered by rank
        >>> callable(spawn)
        True
    """
    check_int("world_size", world_size, 1)
    check_number("timeout", timeout, 0, exclusive_minimum=True)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, fn, world_size, port, pg_timeout, args, out), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            if not out.empty():
                rank, value = out.get()
                if isinstance(value, BaseException):
                    raise RuntimeError(f"rank {rank} raised {type(value).__name__}: {value}") from value
                results[rank] = value
                continue
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead and out.empty():
                raise RuntimeError(f"rank {dead[0][0]} died with exit code {dead[0][1]} before returning a result")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{getattr(fn, '__name__', fn)} did not finish on {world_size} ranks within {timeout}s"
                )
            time.sleep(0.01)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[rank] for rank in range(world_size)]
