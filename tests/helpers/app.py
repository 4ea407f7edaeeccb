"""The app's command line, and :func:`run_app`: the same command, started warm.

``run_app([*APP, *args], timeout)`` runs ``python -m ddp_plugins.train ARGS`` as a fork of a
process that imported the app once (one per pytest worker), and returns what
:func:`ddp_plugins.testing.run_command` returns for the fresh command. Rank 0 skips the ~5 s of
interpreter start and imports, and everything after is the app's own path: ``sys.argv`` and
``__main__`` as ``python -m`` sets them (so Lightning's launcher starts rank 1 as a fresh
``python -m ddp_plugins.train ARGS``), its own session and process group, the given environment,
folder and ``sys.path[0]``, stdin from ``/dev/null`` and its output captured; at the timeout its
process group is killed. A scenario whose proof is the start itself (``make train``, signals
during start-up, the installed wheel, torchrun and Slurm launches) runs ``APP`` fresh.

The server (``python -m tests.helpers.app``) reads one request per line and answers
``started PID``, then ``exit CODE``; it ends when its stdin closes, with the pytest worker.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from ddp_plugins.core.process import system_exit_code
from ddp_plugins.testing import loopback_env

APP = [sys.executable, "-m", "ddp_plugins.train"]


class _AppServer:
    _instance: _AppServer | None = None

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.app"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=loopback_env(), start_new_session=True)  # fmt: skip
        self._pending = b""

    @classmethod
    def get(cls) -> _AppServer:
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def line(self, deadline: float) -> str | None:
        """The server's next line, or None at the deadline (``os.read``: a buffered readline could
        take two lines at once and ``select`` then wait for the second on an empty pipe)."""
        assert self.proc.stdout is not None
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                _AppServer._instance = None
                raise AssertionError(f"the app server ended (exit code {self.proc.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()


def run_app(
    cmd: Sequence[str], timeout: float, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` (``[*APP, *args]``) warm; what ``run_command(cmd, timeout, env, cwd)`` returns."""
    assert list(cmd[: len(APP)]) == APP, f"not an app command line: {cmd}"
    server = _AppServer.get()
    with tempfile.TemporaryDirectory(prefix="ddp_plugins_app_") as logs:
        out, err = Path(logs, "stdout"), Path(logs, "stderr")
        environ = dict(env) if env is not None else loopback_env()
        folder = str(cwd if cwd is not None else os.getcwd())
        request = {"args": list(cmd[len(APP) :]), "env": environ, "cwd": folder, "stdout": str(out), "stderr": str(err)}
        assert server.proc.stdin is not None
        server.proc.stdin.write(json.dumps(request).encode() + b"\n")
        server.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        started = server.line(deadline)
        assert started is not None, f"the app server did not start {cmd} within {timeout}s"
        pid = int(started.split()[1])
        ended = server.line(deadline)
        if ended is None:  # a hang: end the app's process group (its ranks, loader workers)
            os.killpg(pid, 9)
            server.line(time.monotonic() + 60)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if ended is None:
        raise AssertionError(
            f"command did not finish within {timeout}s (hang): {' '.join(cmd)}\n"
            f"--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-4000:]}"
        )
    return subprocess.CompletedProcess(list(cmd), int(ended.split()[1]), stdout, stderr)


def start_app(request: dict) -> NoReturn:
    """In a forked child: become ``python -m ddp_plugins.train ARGS`` as ``run_command`` starts it.

    ``request``: ``args``, ``env``, ``cwd``, and the ``stdout`` and ``stderr`` files. Never returns:
    the app leaves through ``run_main``; anything else ends the child with the exit code a fresh
    interpreter would give.
    """
    code = 0
    try:
        _become_app(request)
    except SystemExit as exc:
        code = system_exit_code(exc)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _become_app(request: dict) -> None:
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.path[0] = request["cwd"]  # what `python -m` puts first
    sys.argv = ["-m", *request["args"]]  # run_module sets argv[0] to the module's file, as `-m` does
    runpy.run_module("ddp_plugins.train", run_name="__main__", alter_sys=True)  # ends through run_main


def _serve() -> None:
    import ddp_plugins.app.train  # noqa: F401 - what the app imports, once

    replies = os.dup(1)  # answers never go through sys.stdout, whose buffer a fork would copy
    for raw in sys.stdin.buffer:
        request = json.loads(raw)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(replies)
            start_app(request)
        os.write(replies, f"started {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(replies, f"exit {os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    _serve()
