"""Multi-process test harness: real gloo ranks on 127.0.0.1 with a hard timeout, so a hang fails in seconds."""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import multiprocessing as mp
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import Self

from ddp_plugins.core.checks import check_int, check_number
from ddp_plugins.core.files import save_atomic
from ddp_plugins.core.process import exit_process, parent_death_signal

__all__ = [
    "LOOPBACK_ENV",
    "DistributedPool",
    "check_ok",
    "free_port",
    "loopback_env",
    "run_command",
    "run_lightning",
    "spawn",
]

#: gloo over loopback, one thread per rank: the environment of every local test and benchmark run.
LOOPBACK_ENV = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
_LAUNCHER_KEYS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")


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
    """``base`` (default: ``os.environ``) on loopback gloo, one thread, ``extra`` added, launcher variables dropped.

    Example::

        >>> env = loopback_env({"RANK": "3", "PATH": "/bin"}, MASTER_PORT="1234")
        >>> env["MASTER_ADDR"], env["MASTER_PORT"], "RANK" in env
        ('127.0.0.1', '1234', False)
    """
    base = os.environ if base is None else base
    inherited = {key: value for key, value in base.items() if key not in _LAUNCHER_KEYS}
    return {**inherited, **LOOPBACK_ENV, **extra}


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
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks, the results ordered by rank.

    ``fn``: a module-level function returning something picklable.

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
            proc.join(timeout=5 if len(results) == world_size else 0)  # after a failure the others are not waited for
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[rank] for rank in range(world_size)]


def _init_worker(ranks: Any, port: int, world_size: int, pg_timeout: float) -> None:
    os.environ.update(LOOPBACK_ENV, MASTER_PORT=str(port))
    torch.set_num_threads(1)
    rank = ranks.get(timeout=60)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))


def _ready(rank: int, world_size: int) -> int:
    return rank


def _call(fn: Callable[..., Any], args: tuple) -> tuple[int, Any]:
    dist.barrier()  # so that no worker takes a second of the world_size tasks
    rank = dist.get_rank()
    return rank, fn(rank, dist.get_world_size(), *args)


class DistributedPool:
    """``world_size`` processes in one gloo group reused across checks (``fn``: importable); a failure or hang ends it.

    Example::

        >>> pool = DistributedPool(world_size=2)  # the ranks start at the first run()
        >>> pool.close()
    """

    def __init__(
        self, world_size: int = 2, timeout: float = 60.0, pg_timeout: float = 30.0, startup_timeout: float = 120.0
    ) -> None:
        check_int("world_size", world_size, 1)
        check_number("timeout", timeout, 0, exclusive_minimum=True)
        check_number("startup_timeout", startup_timeout, 0, exclusive_minimum=True)
        self.world_size, self.timeout = world_size, timeout
        self.startup_timeout, self.pg_timeout = startup_timeout, pg_timeout
        self._pool: Any = None

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank, the results ordered by rank.

        Raises:
            AssertionError: the ranks did not finish within ``timeout`` or did not take one call each.
        """
        if self._pool is None:
            ctx = mp.get_context("forkserver")  # imports torch and fn's module once (spawn: once per rank)
            ctx.set_forkserver_preload(["torch", *([fn.__module__] if fn.__module__ != "__main__" else [])])
            ranks = ctx.Queue()
            for rank in range(self.world_size):
                ranks.put(rank)
            initargs = (ranks, free_port(), self.world_size, self.pg_timeout)
            self._pool = ctx.Pool(self.world_size, initializer=_init_worker, initargs=initargs)
            self._gather(_ready, (), self.startup_timeout, "the ranks did not start")
        return self._gather(fn, args, timeout or self.timeout, f"{fn.__name__} did not finish")

    def _gather(self, fn: Callable[..., Any], args: tuple, timeout: float, what: str) -> list[Any]:
        pending = self._pool.starmap_async(_call, [(fn, args)] * self.world_size, chunksize=1)
        try:
            results = pending.get(timeout)
        except mp.TimeoutError:
            self.close()
            raise AssertionError(f"{what} on {self.world_size} ranks within {timeout}s (hang)") from None
        except BaseException:
            self.close()
            raise
        ranks = sorted(rank for rank, _ in results)
        if ranks != list(range(self.world_size)):
            self.close()
            raise AssertionError(f"{fn.__name__} ran on ranks {ranks}, expected one call per rank")
        return [result for _, result in sorted(results, key=lambda pair: pair[0])]

    def close(self) -> None:
        """Stop the ranks (the next :meth:`run` starts fresh ones)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def run_command(
    cmd: Sequence[str], timeout: float, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group (default env: :func:`loopback_env`), output captured, killed at timeout.

    Raises:
        AssertionError: it did not finish within ``timeout`` seconds (the output's tail is shown).

    Example::

        >>> run_command([sys.executable, "-c", "print('hi')"], timeout=60).stdout
        'hi\\n'
    """
    proc = subprocess.Popen(
        list(cmd),
        env=dict(env) if env is not None else loopback_env(),
        cwd=None if cwd is None else str(cwd),
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
    """``result``, asserting exit code 0 and showing the tail of its output when it is not.

    Example::

        >>> check_ok(run_command([sys.executable, "-c", "pass"], timeout=60)).returncode
        0
    """
    assert result.returncode == 0, (
        f"exit code {result.returncode}, expected 0: {' '.join(map(str, result.args))}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    )
    return result


_FAILURE_GRACE_S = 5.0  # seconds the other ranks get to end by themselves (with their own errors) after one failed
_PRELOAD = ("torch", "lightning.pytorch", "torchmetrics", "ddp_plugins.lightning")  # imported before any fork


def run_lightning(
    target: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 180.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``target(out_dir, *args)`` on ``world_size`` ranks of a Lightning DDP job, results by rank.

    ``target``: a module-level function that builds its ``Trainer(accelerator="cpu", devices=world_size)`` and
    returns a picklable value; the ranks are forked, with torchrun's variables, from a server that imported Lightning.

    Raises:
        AssertionError: a rank exited non-zero, or the ranks did not all finish within ``timeout`` seconds.

    Example::

        >>> # def fit(out_dir): trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp"); ...
        >>> # run_lightning(fit, world_size=2) -> [rank 0's return value, rank 1's]
        >>> callable(run_lightning)
        True
    """
    check_int("world_size", world_size, 1)
    check_number("timeout", timeout, 0, exclusive_minimum=True)
    with tempfile.TemporaryDirectory(prefix="ddp_plugins_run_") as out_dir:
        (Path(out_dir) / "args.pkl").write_bytes(pickle.dumps(args))
        request = {
            "target": f"{target.__module__}:{target.__name__}",
            "out_dir": out_dir,
            "world_size": world_size,
            "env": {**(env or {}), "WORLD_SIZE_HINT": str(world_size), "MASTER_PORT": str(free_port())},
            "cwd": os.getcwd(),
            "path": sys.path,
            "timeout": timeout,
        }
        codes = _RankServer.get().run(request, timeout)
        failed = {rank: code for rank, code in codes.items() if code != 0}
        if failed:
            logs = "".join(_log_tail(Path(out_dir), rank) for rank in sorted(failed))
            raise AssertionError(f"{request['target']}: ranks exited with {failed} (expected 0)\n{logs}")
        return [torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _log_tail(out_dir: Path, rank: int, chars: int = 6000) -> str:
    path = out_dir / f"rank{rank}.log"
    text = path.read_text(errors="replace") if path.exists() else "(no output)"
    return f"--- rank {rank} ---\n{text[-chars:]}\n"


class _ServerProcess:
    """A long-lived ``python -m MODULE`` child per pytest worker: JSON requests in lines on stdin, answers on stdout."""

    module = ""
    _instance: Self | None = None

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=loopback_env(),
            start_new_session=True,
        )
        self._pending = b""

    @classmethod
    def get(cls) -> Self:
        """The running server of this class, started if there is none (or it ended)."""
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def send(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        type(self)._instance = None

    def line(self, deadline: float, what: str) -> str | None:
        """The server's next line, or None at the deadline (``what``: the request, for an error)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:  # os.read: a buffered readline may take two lines, then select waits
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait()
                type(self)._instance = None
                raise AssertionError(f"the server {self.module} ended (exit code {code}) during {what}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()


class _RankServer(_ServerProcess):
    """The server :func:`run_lightning` forks ranks from: a request in; ``pids ...``, then ``exit RANK CODE``."""

    module = "ddp_plugins.testing"

    def run(self, request: dict[str, Any], timeout: float) -> dict[int, int]:
        """Fork the request's ranks and return their exit codes by rank (killed ones: ``-9``)."""
        self.send(request)
        deadline = time.monotonic() + timeout
        started = self.line(deadline, request["target"])
        if started is None:
            self.close()
            raise AssertionError(f"the rank server did not start {request['target']} within {timeout}s")
        pids = [int(pid) for pid in started.split()[1:]]
        codes: dict[int, int] = {}
        failed_at: float | None = None
        while len(codes) < len(pids):
            # a rank that failed leaves the others in a collective: give them a moment, then stop them
            grace = deadline if failed_at is None else min(deadline, failed_at + _FAILURE_GRACE_S)
            line = self.line(grace, request["target"])
            if line is None:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                while len(codes) < len(pids) and (line := self.line(time.monotonic() + 30, request["target"])):
                    _, rank, code = line.split()
                    codes[int(rank)] = int(code)
                if failed_at is None:
                    logs = "".join(_log_tail(Path(request["out_dir"]), rank, 3000) for rank in range(len(pids)))
                    raise AssertionError(
                        f"{request['target']} did not finish on {len(pids)} ranks within {timeout}s (hang)\n{logs}"
                    )
                break
            _, rank, code = line.split()
            codes[int(rank)] = int(code)
            if int(code) != 0 and failed_at is None:
                failed_at = time.monotonic()
        return codes


def _serve() -> None:
    """The rank server's loop (``python -m ddp_plugins.testing``): import once, fork per request."""
    for name in _PRELOAD:
        importlib.import_module(name)
    dies_with_server = parent_death_signal(signal.SIGKILL)  # looked up here, called in each rank
    for raw in sys.stdin.buffer:
        request = json.loads(raw)
        pids = {}
        for rank in range(request["world_size"]):
            pid = os.fork()
            if pid == 0:
                _rank(request, rank, dies_with_server)  # never returns
            pids[pid] = rank
        print("pids", *pids, flush=True)
        while pids:
            pid, status = os.wait()
            if pid in pids:
                print("exit", pids.pop(pid), os.waitstatus_to_exitcode(status), flush=True)


def _rank(request: dict[str, Any], rank: int, dies_with_server: Callable[[], None] | None) -> None:
    """One forked rank: its own process group and log file, the launcher's variables, the target."""
    code = 1
    try:
        os.setpgid(0, 0)
        if dies_with_server is not None:
            dies_with_server()
        out_dir = Path(request["out_dir"])
        with open(os.devnull) as null, open(out_dir / f"rank{rank}.log", "w") as log:
            for file, fd in ((null, 0), (log, 1), (log, 2)):
                os.dup2(file.fileno(), fd)
        world_size = str(request["world_size"])
        os.environ.update(
            request["env"], RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=world_size,
            LOCAL_WORLD_SIZE=world_size,
        )  # fmt: skip
        os.chdir(request["cwd"])
        sys.path[:] = request["path"]
        torch.set_num_threads(1)
        # a hang shows where each rank was: every thread's stack, in the rank's log, just before the kill
        faulthandler.dump_traceback_later(max(request["timeout"] - 1.0, 0.5))
        module_name, func_name = request["target"].split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        args = pickle.loads((out_dir / "args.pkl").read_bytes())
        save_atomic(func(str(out_dir), *args), out_dir / f"rank{rank}.pt")
        code = 0
    except BaseException:  # noqa: BLE001 - reported in the rank's log, the exit code says it failed
        traceback.print_exc()
    exit_process(code)  # no interpreter finalization: no gloo abort at exit


if __name__ == "__main__":
    _serve()
