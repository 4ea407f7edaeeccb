"""Distributed helpers.

Small rank helpers shared by the plugin modules, and the clean process exit that every
process of a DDP run goes through.

Why the clean exit exists (torch 2.13 + gloo, about 1 process in 10 aborts at exit)
------------------------------------------------------------------------------------
Every gloo collective is an ``AsyncWork`` object that captures the caller's
``at::ThreadLocalState``, which holds Python objects (``c10::SafePyObject``). The work runs on a
``pt_gloo_runloop`` thread; that thread completes the work's future (which wakes the caller) and
only *then* drops its own reference to the work. If the main thread reaches interpreter
shutdown in that window (or the last reference goes away later, when garbage collection
destroys the DDP reducer and the process group), the runloop thread must take the GIL to
decref the Python object. During finalization CPython answers ``take_gil`` with
``pthread_exit()``; the forced unwind crosses a ``noexcept`` C++ destructor, so libstdc++ calls
``std::terminate()``: "terminate called without an active exception" and SIGABRT (exit 134),
after all the work was done. ``destroy_process_group()`` does not help: DDP's reducer still owns
the process group, so its threads outlive the call.

The fix: a DDP process never enters interpreter finalization while gloo threads may hold
Python state. :func:`exit_process` tears the process group down while the interpreter is fully
alive, runs the ``atexit`` handlers and flushes every stream (so nothing is lost), then leaves
with ``os._exit``, exactly as ``multiprocessing`` ends its forked children. :func:`run_main`
wraps an entry point with it and turns exceptions into the usual exit codes.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

__all__ = ["exit_process", "get_rank", "get_world_size", "rank_zero_first", "run_main"]


def get_rank() -> int:
    """The global rank, 0 when no process group is initialized."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The world size, 1 when no process group is initialized."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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


def exit_process(code: int = 0) -> NoReturn:
    """Tear down distributed state and end the process with ``code``, skipping finalization.

    See the module docstring for the gloo abort this avoids. Everything that a normal exit would
    do for the user still happens: ``atexit`` handlers run, logging is shut down and stdout and
    stderr are flushed before ``os._exit``.
    """
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        atexit._run_exitfuncs()
        logging.shutdown()
    except BaseException:  # noqa: BLE001 - a failing handler must not change a clean exit code silently
        traceback.print_exc()
        code = code or 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def run_main(main: Callable[[], Any]) -> NoReturn:
    """Run ``main()`` and leave through :func:`exit_process` with the usual exit code.

    ``SystemExit`` keeps its code (a message goes to stderr with code 1, as Python does), an
    uncaught exception prints its traceback and exits 1, ``KeyboardInterrupt`` exits 130.
    """
    code = 0
    try:
        main()
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - report like the interpreter would, then exit cleanly
        traceback.print_exc()
        code = 1
    exit_process(code)
