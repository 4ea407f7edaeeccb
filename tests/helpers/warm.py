"""Start ``python -m MODULE ARGS`` warm: a fork of a process that imported the app once.

``run_warm(cmd, timeout)`` returns what :func:`ddp_plugins.testing.run_command` returns for the
same command (``[sys.executable, "-m", MODULE, *args]``; :data:`APP` is the app's): the exit code,
and the output of every process that holds it, once all of them are gone. The command runs as a
fork of a server that imported the app and Lightning once (one per pytest worker), so it skips
the ~8 s of CPU of interpreter start and imports; everything after is the module's own path:
``sys.argv`` and ``__main__`` as ``python -m`` sets them, its own session and process group, the
given environment, folder and ``sys.path[0]``, stdin from ``/dev/null``. At the timeout its
process group is killed. Its child ranks start warm too: the launcher starts each as
``sys.executable -m MODULE ARGS``, and ``sys.executable`` there is tests/helpers/warm_child.py,
which has a zygote (a fork of the run taken before its module ran) fork the rank and stands for it
(:func:`_start_zygote`). A scenario whose proof is the start itself (``make train``, signals during
start-up, the installed wheel, torchrun and Slurm launches) runs its command fresh.

The server (``python -m tests.helpers.warm``) says ``ready`` once it has imported the app, then
reads one request per line and answers ``started PID``, then ``exit CODE`` once no process holds
the output files as its stdout or stderr (``run_command`` reads its pipes until every holder has
closed them); it ends when its stdin closes, with the pytest worker.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from ddp_plugins.core.process import parent_death_signal, system_exit_code
from ddp_plugins.testing import _ServerProcess, loopback_env
from tests.helpers.warm_child import FORWARDED, ZYGOTE

APP = [sys.executable, "-m", "ddp_plugins.train"]
_child_python = sys.executable  # in the server: its copy of tests/helpers/warm_child.py, runnable


class _Server(_ServerProcess):
    module = "tests.helpers.warm"

    def __init__(self) -> None:
        super().__init__()
        # its imports are the fresh start that run_warm's commands skip: not part of their timeouts
        if self.line(time.monotonic() + 300, "its start") != "ready":
            self.close()
            raise AssertionError("the warm server did not start within 300 s")


def run_warm(
    cmd: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    warm_children: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` (``[sys.executable, "-m", MODULE, *args]``) warm: ``run_command(cmd, timeout, env, cwd)``;
    ``warm_children=False``: its child ranks start fresh (a proof about their start-up)."""
    assert list(cmd[:2]) == [sys.executable, "-m"] and len(cmd) > 2, f"not a `python -m` command line: {cmd}"
    server = _Server.get()
    with tempfile.TemporaryDirectory(prefix="ddp_plugins_warm_") as logs:
        out, err = Path(logs, "stdout"), Path(logs, "stderr")
        environ = dict(env) if env is not None else loopback_env()
        folder = str(cwd if cwd is not None else os.getcwd())
        request = {"module": cmd[2], "args": list(cmd[3:]), "env": environ, "cwd": folder,
                   "stdout": str(out), "stderr": str(err), "zygote": warm_children}  # fmt: skip
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


def start(become: Callable[[], None]) -> NoReturn:
    """In a forked child: ``become()`` (which runs the module) and exit as a fresh interpreter would.

    Never returns: the exit code is the one a fresh interpreter would give (the app and
    ``tests.helpers.launch`` leave through ``run_main`` before that).
    """
    code = 0
    try:
        become()
    except SystemExit as exc:
        code = system_exit_code(exc)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def become(request: dict, zygote: bool = True) -> None:
    """``python -m MODULE ARGS`` as ``run_command`` starts it (``request``: ``module``, ``args``, ``env``,
    ``cwd``, and the ``stdout`` and ``stderr`` files); ``zygote``: its child ranks start warm."""
    os.setsid()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):  # fmt: skip
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    _enter(request["cwd"], request["env"], request["args"])
    if zygote:
        _start_zygote()
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _enter(cwd: str, env: Mapping[str, str], args: Sequence[str]) -> None:
    """The folder, environment, ``sys.path[0]`` and ``sys.argv`` that ``python -m`` gives in ``cwd``."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[0] = cwd  # what `python -m` puts first
    sys.argv = ["-m", *args]  # run_module sets argv[0] to the module's file, as `-m` does


def _start_zygote() -> None:
    """Fork this process, before it runs its module, into a zygote its child ranks are forked from.

    Its launcher starts them as ``sys.executable -m MODULE ARGS``: ``sys.executable`` here is
    tests/helpers/warm_child.py, which hands its command and files to the zygote and stands for the
    rank it forks (a fresh rank spends ~8 s of CPU importing Lightning). The zygote dies with this
    process; a rank it forked dies with it until the rank clears its parent-death signal after
    start-up, as the launcher's fresh children do.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    name = f"ddp_plugins_warm_{os.getpid()}_{time.monotonic_ns()}"
    listener.bind("\0" + name)
    listener.listen(16)
    dies_with_run = parent_death_signal(signal.SIGKILL)
    if os.fork() == 0:
        _zygote(listener, dies_with_run)
    listener.close()
    os.environ[ZYGOTE] = "@" + name
    sys.executable = _child_python


def _zygote(listener: socket.socket, dies_with_run: Callable[[], None] | None) -> NoReturn:
    """Fork a rank per connection; answer ``pid PID``, then ``exit CODE``; kill it if its stand-in goes."""
    if dies_with_run is not None:
        dies_with_run()
    kept = {sig: signal.signal(sig, signal.SIG_IGN) for sig in FORWARDED}  # the group's signals are the ranks'
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the run's output is held only by the processes that write to it
        os.dup2(null, fd)
    dies_with_zygote = parent_death_signal(signal.SIGKILL)
    ranks: dict[socket.socket, int] = {}
    while True:
        readable, _, _ = select.select([listener, *ranks], [], [], 0.05)
        for conn in readable:
            if conn is listener:
                stand_in, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(stand_in, 1 << 20, 256)
                pid = os.fork()
                if pid == 0:
                    for sock in (listener, *ranks):
                        sock.close()
                    for sig, handler in kept.items():
                        signal.signal(sig, handler)
                    start(functools.partial(_become_child, json.loads(message), fds, dies_with_zygote))
                for fd in fds:
                    os.close(fd)
                stand_in.sendall(f"pid {pid}".encode())
                ranks[stand_in] = pid
            elif not conn.recv(64):  # its stand-in is gone (killed): so is the rank, as a fresh one would be
                with contextlib.suppress(ProcessLookupError):
                    os.kill(ranks.pop(conn), signal.SIGKILL)
                conn.close()  # no one to tell its exit: reaped below without an answer
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            for conn, rank in list(ranks.items()):
                if rank == pid:
                    with contextlib.suppress(OSError):
                        conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}".encode())
                    conn.close()
                    del ranks[conn]


def _become_child(request: dict, fds: list[int], dies_with_zygote: Callable[[], None] | None) -> None:
    """In a rank forked by the zygote: the stand-in's open files at their numbers, then its module."""
    if dies_with_zygote is not None:
        dies_with_zygote()
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(request["fds"], moved, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    _enter(request["cwd"], request["env"], request["args"][1:])
    runpy.run_module(request["args"][0], run_name="__main__", alter_sys=True)


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
    global _child_python
    import ddp_plugins.app.train  # noqa: F401 - what the app (and Lightning) imports, once

    folder = tempfile.mkdtemp(prefix="ddp_plugins_warm_python_")
    _child_python = os.path.join(folder, "python")
    with open(_child_python, "w") as script:
        script.write(f"#!{sys.executable} -S\n" + Path(__file__).with_name("warm_child.py").read_text())
    os.chmod(_child_python, 0o755)
    try:
        _answer()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _answer() -> None:
    replies = os.dup(1)  # answers never go through sys.stdout, whose buffer a fork would copy
    os.write(replies, b"ready\n")
    for raw in sys.stdin.buffer:
        request = json.loads(raw)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(replies)
            start(functools.partial(become, request, request["zygote"]))
        os.write(replies, f"started {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        while _holders({request["stdout"], request["stderr"]}):  # its ranks, workers: as a pipe's EOF
            time.sleep(0.05)
        os.write(replies, f"exit {os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    _serve()
