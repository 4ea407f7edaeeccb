"""Process exit
============

The clean exit every process of a DDP run goes through (:func:`run_main`, :func:`exit_process`),
the parent-death signal that ends a child rank with its launcher, and the forkserver started deaf
to a job's stop signals. The atomic write lives in :mod:`ddp_plugins.core.files`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
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

    A DDP process that finalizes the interpreter can abort after its work is done (the gloo abort
    at exit, ``docs/design.md``). Everything that a normal exit would do for the user still
    happens: ``atexit`` handlers run, logging is shut down and stdout and stderr are flushed before
    ``os._exit``. Daemonic ``multiprocessing`` children left running (DataLoader workers) are killed.

    Example::

        >>> import subprocess
        >>> script = "from ddp_plugins.core.process import exit_process; print('flushed'); exit_process(4)"
        >>> done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        >>> done.returncode, done.stdout.strip()
        (4, 'flushed')
    """
    try:
        _kill_daemonic_children()
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


def _kill_daemonic_children() -> None:
    """Kill this process's daemonic ``multiprocessing`` children (DataLoader workers) before exit.

    Under ``DDPPluginsStrategy`` DataLoader workers ignore SIGTERM, so that a preemption signal sent
    to the whole process group does not kill them mid-batch. ``multiprocessing``'s own exit handler
    ends daemonic children with SIGTERM and then joins them: a rank that exits while its workers
    still run (after an error in a batch) would wait forever. Workers hold nothing to flush.
    """
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(5)


def parent_death_signal(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process dies.

    Linux's ``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``; a child whose parent died before it
    set it signals itself at once. ``parent_death_signal(0)()`` clears it in the calling process.
    The signal follows the *thread* that started the child: start it from one that lives long enough.

    Returns:
        The function, or None off Linux (nothing to do there).

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

    Slurm and a terminal signal a whole job step or process group; a preemption signal that killed
    the forkserver failed the rank's next loader ("DataLoader worker exited unexpectedly") while the
    ranks were stopping. Both start with SIGTERM, SIGUSR1, SIGUSR2 and SIGHUP blocked, which they
    inherit; this thread's mask is restored after. Nothing happens when they already run.
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

    ``SystemExit`` keeps its code (a message goes to stderr with code 1, as Python does), an
    uncaught exception prints its traceback and exits 1, ``KeyboardInterrupt`` exits 130.

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
    """Leave through :func:`exit_process` when the interpreter exits, for a process whose entry
    point is not ours (a submitit task runs the job inside ``python -m submitit.core._submit``).

    At interpreter exit, before finalization begins, the other ``atexit`` handlers run, streams
    are flushed and the process ends with ``code`` (the last call's), or with 1 when an uncaught
    exception was reported after the call. The caller passes what the interpreter would have
    exited with: 0 after a job returned (or failed inside Hydra's ``run_job``, which exits 0),
    the code of a ``SystemExit`` it lets through.

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
    code = _exit_code if _exit_code is not None else 0
    if getattr(sys, "last_value", None) is not None:  # the interpreter reported an uncaught exception
        code = 1
    exit_process(code)
