"""Start ``python -m MODULE ARGS`` warm: a fork of a process that imported the app once.

``run_warm(cmd, timeout)`` returns what :func:`ddp_plugins.testing.run_command` returns for the
same command (``[sys.executable, "-m", MODULE, *args]``; :data:`APP` is the app's): the exit code,
and the output of every process that holds it, once all of them are gone. The command runs as a
fork of a server that imported the app and Lightning once (one per pytest worker), so it skips
the ~5 s of interpreter start and imports; everything after is the module's own path: ``sys.argv``
and ``__main__`` as ``python -m`` sets them (so Lightning's launcher starts rank 1 as a fresh
``python -m MODULE ARGS``), its own session and process group, the given environment, folder and
``sys.path[0]``, stdin from ``/dev/null``. At the timeout its process group is killed. A scenario
whose proof is the start itself (``make train``, signals during start-up, the installed wheel,
torchrun and Slurm launches) runs its command fresh.

The server (``python -m tests.helpers.warm``) says ``ready`` once it has imported the app, then
reads one request per line and answers ``started PID``, then ``exit CODE`` once no process holds
the output files as its stdout or stderr (``run_command`` reads its pipes until every holder has
closed them); it ends when its stdin closes, with the pytest worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from ddp_plugins.core.process import system_exit_code
from ddp_plugins.testing import _ServerProcess, loopback_env

APP = [sys.executable, "-m", "ddp_plugins.train"]


class _Server(_ServerProcess):
    module = "tests.helpers.warm"

    def __init__(self) -> None:
        super().__init__()
        # its imports are the fresh start that run_warm's commands skip: not part of their timeouts
        if self.line(time.monotonic() + 300, "its start") != "ready":
            self.close()
            raise AssertionError("the warm server did not start within 300 s")


def run_warm(
    cmd: Sequence[str], timeout: float, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` (``[sys.executable, "-m", MODULE, *args]``) warm: ``run_command(cmd, timeout, env, cwd)``."""
    assert list(cmd[:2]) == [sys.executable, "-m"] and len(cmd) > 2, f"not a `python -m` command line: {cmd}"
    server = _Server.get()
    with tempfile.TemporaryDirectory(prefix="ddp_plugins_warm_") as logs:
        out, err = Path(logs, "stdout"), Path(logs, "stderr")
        environ = dict(env) if env is not None else loopback_env()
        folder = str(cwd if cwd is not None else os.getcwd())
        request = {"module": cmd[2], "args": list(cmd[3:]), "env": environ, "cwd": folder,
                   "stdout": str(out), "stderr": str(err)}  # fmt: skip
        server.send(request)
        deadline = time.monotonic() + timeout
        started = server.line(deadline, cmd[2])
        if started is None:
            server.close()
            raise AssertionError(f"the warm server did not start {cmd} within {timeout}s")
        pid = int(started.split()[1])
        ended = server.line(deadline, cmd[2])
        if ended is None:  # a hang: end its process group (ranks, loader workers), as run_command does
            with contextlib.suppress(ProcessLookupError):  # all gone since the deadline
                os.killpg(pid, 9)
            if server.line(time.monotonic() + 60, cmd[2]) is None:
                server.close()  # its processes outlived the kill of their group: start afresh next time
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if ended is None:
        raise AssertionError(
            f"command did not finish within {timeout}s (hang): {' '.join(cmd)}\n"
            f"--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-4000:]}"
        )
    return subprocess.CompletedProcess(list(cmd), int(ended.split()[1]), stdout, stderr)


def start(request: dict) -> NoReturn:
    """In a forked child: become ``python -m MODULE ARGS`` as ``run_command`` starts it.

    ``request``: ``module``, ``args``, ``env``, ``cwd``, and the ``stdout`` and ``stderr`` files.
    Never returns: the exit code is the one a fresh interpreter would give (the app and
    ``tests.helpers.launch`` leave through ``run_main`` before that).
    """
    code = 0
    try:
        _become(request)
    except SystemExit as exc:
        code = system_exit_code(exc)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _become(request: dict) -> None:
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):  # fmt: skip
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.path[0] = request["cwd"]  # what `python -m` puts first
    sys.argv = ["-m", *request["args"]]  # run_module sets argv[0] to the module's file, as `-m` does
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _holders(paths: set[str]) -> list[int]:
    """The processes whose stdout or stderr is one of ``paths``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for fd in (1, 2):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in paths:
                    found.append(int(pid))
                    break
            except OSError:  # gone, or not ours to read
                pass
    return found


def _serve() -> None:
    import ddp_plugins.app.train  # noqa: F401 - what the app (and Lightning) imports, once

    replies = os.dup(1)  # answers never go through sys.stdout, whose buffer a fork would copy
    os.write(replies, b"ready\n")
    for raw in sys.stdin.buffer:
        request = json.loads(raw)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(replies)
            start(request)
        os.write(replies, f"started {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        while _holders({request["stdout"], request["stderr"]}):  # its ranks, workers: as a pipe's EOF
            time.sleep(0.05)
        os.write(replies, f"exit {os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    _serve()
