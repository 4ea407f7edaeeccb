"""The clean exit every DDP process goes through, the parent-death signal, a forkserver deaf to stop signals."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from ddp_plugins import _compat

__all__ = [
    "STOP_SIGNALS",
    "exit_at_interpreter_exit",
    "exit_process",
    "owns_exit",
    "parent_death_signal",
    "run_main",
    "start_forkserver",
    "system_exit_code",
]

_run_main_active = False  # run_main is this process's entry point: it ends it through exit_process
_exit_code: int | None = None  # the code exit_at_interpreter_exit leaves with; None: not armed
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_process(code: int = 0) -> NoReturn:
    """End the process with ``code``, skipping interpreter finalization.

    Finalizing can abort a DDP process after its work is done (docs/design.md, "When a rank fails or stops").
    ``atexit`` handlers run, logging shuts down, streams are flushed, daemonic children (loader workers) are killed.

    Example::

        >>> import subprocess
        >>> script = "from ddp_plugins.core.process import exit_process; print('flushed'); exit_process(4)"
        >>> done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        >>> done.returncode, done.stdout.strip()
        (4, 'flushed')
    """
    try:
        # our loader workers ignore SIGTERM, which multiprocessing's exit would send, then wait for forever
        for child in multiprocessing.active_children():
            if child.daemon:
                child.kill()
                child.join(5)
        _compat.run_exit_functions()
        logging.shutdown()
    except BaseException:  # noqa: BLE001 - a failing handler must not change a clean exit code silently
        traceback.print_exc()
        code = code or 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def parent_death_signal(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process dies.

    Linux's ``prctl(PR_SET_PDEATHSIG)`` (None elsewhere); ``parent_death_signal(0)()`` clears it.
    The signal follows the *thread* that started the child: start it from one that lives long enough.

    Example::

        >>> import subprocess, time
        >>> script = (
        ...     "import subprocess; from ddp_plugins.core.process import parent_death_signal\\n"
        ...     "subprocess.Popen(['sleep', '60'], preexec_fn=parent_death_signal(9))"
        ... )
        >>> start = time.monotonic()  # `run` also waits for the sleeper, which holds its stdout
        >>> _ = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, timeout=50)
        >>> time.monotonic() - start < 30  # the sleeper was killed when its parent exited
        True
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def set_signal() -> None:
        if prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(sig), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
            raise OSError(ctypes.get_errno(), f"prctl(PR_SET_PDEATHSIG, {sig}) failed")
        if sig and os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return set_signal


STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")


def start_forkserver() -> None:
    """Start multiprocessing's forkserver and resource tracker deaf to a job's stop signals.

    Slurm signals a whole job step: a killed forkserver failed the next loader of stopping ranks. They inherit the mask.
    """
    import signal
    from multiprocessing import forkserver, resource_tracker

    signals = {getattr(signal, name) for name in STOP_SIGNALS}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        resource_tracker.ensure_running()  # unblocks SIGINT and SIGTERM again on its way out
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def system_exit_code(exc: SystemExit) -> int:
    """The exit code the interpreter gives a ``SystemExit``: its int code, 0 for None, else 1.

    Example::

        >>> system_exit_code(SystemExit(3)), system_exit_code(SystemExit()), system_exit_code(SystemExit("bye"))
        (3, 0, 1)
    """
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def run_main(main: Callable[[], Any]) -> NoReturn:
    """Run ``main()`` and leave through :func:`exit_process` with the usual exit code.

    As Python does: ``SystemExit`` keeps its code, an uncaught exception exits 1, Ctrl-C 130.

    Example::

        >>> import subprocess
        >>> script = "from ddp_plugins.core.process import run_main; run_main(lambda: exit(3))"
        >>> subprocess.run([sys.executable, "-c", script]).returncode
        3
    """
    global _run_main_active
    _run_main_active = True
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = system_exit_code(exc)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - report like the interpreter would, then exit cleanly
        traceback.print_exc()
        code = 1
    exit_process(code)


def owns_exit() -> bool:
    """Whether this process leaves through :func:`exit_process` (its entry point is :func:`run_main`)."""
    return _run_main_active


def exit_at_interpreter_exit(code: int) -> None:
    """Leave through :func:`exit_process` with ``code`` (the last call's; 1 after an uncaught exception)
    when the interpreter exits, for a process whose entry point is not ours (a submitit task).

    Example::

        >>> import subprocess
        >>> script = (
        ...     "import atexit; from ddp_plugins.core.process import exit_at_interpreter_exit\\n"
        ...     "atexit.register(print, 'other handler ran')\\n"
        ...     "exit_at_interpreter_exit(143); raise SystemExit(143)"
        ... )
        >>> result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        >>> result.returncode, result.stdout
        (143, 'other handler ran\\n')
    """
    global _exit_code
    if _exit_code is None:
        atexit.register(_exit_now)
    _exit_code = int(code)


def _exit_now() -> None:
    atexit.unregister(_exit_now)
    uncaught = getattr(sys, "last_value", None) is not None  # the interpreter reported an uncaught exception
    exit_process(1 if uncaught else _exit_code or 0)
