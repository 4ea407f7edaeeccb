"""Run test code on N gloo CPU processes on 127.0.0.1 with a hard timeout.

The loopback environment and free ports come from :mod:`ddp_plugins.core.toolkit`, the one
toolkit the tests, benchmarks and notebooks share. Two tools on top of it:

* :class:`DistributedPool` keeps ``world_size`` spawned workers with a live gloo process group
  and runs many small module-level ``_test_*`` functions on all of them (torchmetrics' pattern),
  so collective tests cost milliseconds instead of a process start each.
* :func:`run_lightning` runs a module-level function as the entry point of a real Lightning
  ``strategy="ddp"`` job (Lightning re-launches the script for every rank) in a subprocess and
  returns what each rank's function returned.

Both kill everything they started when the timeout passes, so a hang fails in seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ddp_plugins.core.toolkit import LOOPBACK_ENV, free_port
from ddp_plugins.core.toolkit import loopback_env as _toolkit_loopback_env

REPO_ROOT = Path(__file__).resolve().parents[2]


def loopback_env(**extra: str) -> dict[str, str]:
    """:func:`ddp_plugins.core.toolkit.loopback_env` of this environment, with the repo importable.

    The checkout goes first on ``PYTHONPATH`` so child processes started from another folder (a
    script in ``tmp_path``, a notebook kernel) import ``tests.*``.
    """
    env = _toolkit_loopback_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    return env


def _init_worker(ranks: Any, port: int, world_size: int, pg_timeout: float) -> None:
    import torch.distributed as dist

    os.environ.update(LOOPBACK_ENV, MASTER_PORT=str(port))
    torch.set_num_threads(1)
    rank = ranks.get(timeout=60)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))


def _call(fn: Callable[..., Any], args: tuple) -> tuple[int, Any]:
    import torch.distributed as dist

    # Each worker takes exactly one of the world_size tasks: a worker cannot pick up a second
    # task before every rank has entered this barrier.
    dist.barrier()
    rank = dist.get_rank()
    return rank, fn(rank, dist.get_world_size(), *args)


class DistributedPool:
    """``world_size`` spawned processes in one gloo group, reused across tests.

    ``run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank and returns the results
    ordered by rank. A failure or a hang (past ``timeout`` seconds) tears the pool down, so the
    next test starts from a fresh group, and raises in the test.
    """

    def __init__(self, world_size: int = 2, timeout: float = 60.0, pg_timeout: float = 30.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self._pool: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        ranks = ctx.Queue()
        for rank in range(self.world_size):
            ranks.put(rank)
        self._pool = ctx.Pool(
            self.world_size,
            initializer=_init_worker,
            initargs=(ranks, free_port(), self.world_size, self.pg_timeout),
        )

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        if self._pool is None:
            self._start()
        pending = self._pool.starmap_async(_call, [(fn, args)] * self.world_size, chunksize=1)
        try:
            results = pending.get(timeout or self.timeout)
        except mp.TimeoutError:
            self.close()
            raise AssertionError(
                f"{fn.__name__} did not finish on {self.world_size} ranks within {timeout or self.timeout}s (hang)"
            ) from None
        except BaseException:
            self.close()
            raise
        ranks = sorted(rank for rank, _ in results)
        if ranks != list(range(self.world_size)):
            self.close()
            raise AssertionError(f"{fn.__name__} ran on ranks {ranks}, expected one call per rank")
        return [result for _, result in sorted(results, key=lambda pair: pair[0])]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def run_command(
    cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the whole group and fail."""
    proc = subprocess.Popen(
        list(cmd),
        env=env or loopback_env(),
        cwd=str(cwd or REPO_ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"command did not finish within {timeout}s (hang): {' '.join(cmd)}\n"
            f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def check_ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Assert exit code 0, showing the tail of the output when it is not."""
    assert result.returncode == 0, (
        f"exit code {result.returncode}, expected 0: {' '.join(result.args)}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    )
    return result


def run_lightning(
    target: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``target(out_dir, *args)`` as a Lightning DDP script on ``world_size`` CPU ranks.

    ``target`` is a module-level function; it builds its own ``Trainer(accelerator="cpu",
    devices=world_size, strategy="ddp")`` (``world_size`` is passed as ``WORLD_SIZE_HINT``)
    and returns a picklable result. Lightning re-runs the launcher module for each child rank;
    each rank saves its result atomically and this returns them ordered by rank.
    """
    import pickle

    with tempfile.TemporaryDirectory(prefix="ddp_plugins_run_") as out_dir:
        arg_file = Path(out_dir) / "args.pkl"
        arg_file.write_bytes(pickle.dumps(args))
        cmd = [
            sys.executable,
            "-m",
            "tests.helpers.launch",
            f"{target.__module__}:{target.__name__}",
            out_dir,
        ]
        extra = {"WORLD_SIZE_HINT": str(world_size), "MASTER_PORT": str(free_port())}
        result = run_command(cmd, timeout, env={**loopback_env(**extra), **(env or {})})
        check_ok(result)
        outputs = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pt"
            assert path.exists(), f"rank {rank} wrote no result\n{result.stderr[-4000:]}"
            # what the test's own ranks returned (any picklable value), from this call's private temp folder
            outputs.append(torch.load(path, weights_only=False))
        return outputs


__all__ = [
    "DistributedPool",
    "LOOPBACK_ENV",
    "REPO_ROOT",
    "check_ok",
    "free_port",
    "loopback_env",
    "run_command",
    "run_lightning",
]
