"""Launchers of the DDP strategy: a child command of the caller's choice, a rank watcher, no orphans.

Rationale in docs/design.md ("When a rank fails or stops")."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from ddp_plugins import _compat
from ddp_plugins.core.preemption import Preempted
from ddp_plugins.core.process import exit_process, parent_death_signal
from ddp_plugins.core.stalls import describe_collective_failure
from ddp_plugins.lightning.contracts import CarriesSpawnResults, of_kind
from ddp_plugins.lightning.data_plan import ResumeMismatch

__all__ = ["REFUSAL_EXIT", "ChildCommand", "CleanExitMultiprocessingLauncher", "JobSubprocessLauncher", "failure_tag"]

_CHILD_GRACE_S = 2.0  # seconds a child rank gets to exit on its own once rank 0 failed, before it is killed
_PREEMPT_GRACE_S = 30.0  # children of a preempted run only tear down and exit
_STARTUP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# In a child rank's environment: it got a parent-death signal, to clear once its start-up is done
_DIES_WITH_LAUNCHER = "DDP_PLUGINS_DIES_WITH_LAUNCHER"
_SPAWN_RESULTS_KEY = "ddp_plugins.spawn_results"  # callbacks' results, from spawned rank 0
ChildCommand = Callable[[int], tuple[list[str], str | None]]  # local rank -> (command, working folder)

REFUSAL_EXIT = 2
"""The exit code of a rank that refused its job with one line (a config or a resume it cannot run):
every rank decides alike and rank 0 prints the line, so it is no crash to report."""


def _agreed_code(code: int | None) -> bool:
    """An exit every rank reaches alike (:class:`Preempted`'s 128 + signal, or a refusal): rank 0 ends the same way."""
    return code is not None and (128 < code < 128 + signal.NSIG or code == REFUSAL_EXIT)


class _RankWatcher(threading.Thread):
    """Watches the child ranks; when one fails, says which and how on stderr, and stops every rank.

    Unlike Lightning's ``_ChildProcessObserver`` (INFO level, usually hidden), it can be stopped.
    """

    def __init__(self, procs: list[Any], halt: threading.Event) -> None:
        super().__init__(daemon=True, name="ddp-plugins-rank-watcher")
        self.procs = procs
        self._halt = halt

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()

    @override
    def run(self) -> None:
        while not self._halt.wait(1.0):
            codes = [proc.poll() for proc in self.procs]
            if all(code == 0 or _agreed_code(code) for code in codes):
                return  # every child ended, or stopped for a preemption signal or refused: rank 0 does the same
            failed = [(rank, code) for rank, code in enumerate(codes, 1) if code and not _agreed_code(code)]
            if failed and not self._halt.is_set():
                rank, code = failed[0]
                message = f"rank {rank} (PID {self.procs[rank - 1].pid}) {_describe_exit(code)}; stopping every rank."
                print(f"[ddp_plugins] {message}", file=sys.stderr, flush=True)
                for other in self.procs:
                    if other.poll() is None:
                        other.send_signal(signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)


class JobSubprocessLauncher(_compat.SubprocessScriptLauncher):
    """Lightning's subprocess launcher with a rank watcher, and no orphans.

    ``child_command(local_rank)`` gives each child rank's command and working folder (default:
    Lightning's). It stops the child ranks when rank 0 raises (not only on ``KeyboardInterrupt``),
    and holds SIGTERM and SIGINT from before the first child starts until :meth:`startup_done`.
    """

    _startup: _StartupSignals | None = None
    _halt: threading.Event | None = None

    def __init__(
        self,
        *args: Any,
        before_launch: Callable[[Any], None] | None = None,
        child_command: ChildCommand | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.before_launch = before_launch  # the strategy's checks of the Trainer, before any child starts
        self.child_command = child_command or _compat.subprocess_cmd  # default: Lightning's command

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self.before_launch is not None and trainer is not None:
            self.before_launch(trainer)
        watcher = None
        try:
            if not self.cluster_environment.creates_processes_externally:
                self._halt = threading.Event()
                self._startup = _StartupSignals(self._stop_startup).install()
                self._call_children_scripts()
                watcher = _RankWatcher(self.procs, self._halt)
                watcher.start()
            _compat.set_num_threads_if_needed(self.num_processes)
            return function(*args, **kwargs)
        except BaseException as error:
            if watcher is None:
                raise
            watcher.stop()
            if isinstance(error, (Preempted, ResumeMismatch)):
                # every rank agreed to stop at this step and wrote its part, or refuses the same resume
                # with rank 0's one line: let the children finish
                _wait_then_kill(self.procs, _PREEMPT_GRACE_S)
            else:
                # which rank stopped, asked before the children are stopped (then they cannot answer)
                module = trainer.lightning_module if trainer is not None else None
                self._stop_children(describe_collective_failure(error, tag=failure_tag(module)))
            raise
        finally:
            self.startup_done()  # a start-up that failed gives the handlers back all the same
            if watcher is not None:  # no thread outlives fit (stopping twice is harmless)
                watcher.stop()

    def startup_done(self) -> None:
        """The ranks have met (the strategy calls this once set up): SIGTERM and SIGINT get their
        handlers back, and a child rank's parent-death signal is cleared."""
        if self._startup is not None:
            self._startup.restore()
            self._startup = None
        if os.environ.pop(_DIES_WITH_LAUNCHER, None) is not None:
            clear = parent_death_signal(0)
            if clear is not None:
                clear()

    def _stop_startup(self, signum: int) -> None:
        """SIGTERM or SIGINT while the ranks start: forward it to the child ranks, kill those left after
        :data:`_CHILD_GRACE_S`, exit ``128 + signal`` with ``os._exit`` (the main thread may be blocked
        in the rendezvous: ``atexit`` handlers could wait for it)."""
        if self._halt is not None:
            self._halt.set()  # the rank watcher must not take the children's exit for a failure
        procs = list(self.procs)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)
        _wait_then_kill(procs, _CHILD_GRACE_S)
        code = 128 + signum
        message = f"{signal.Signals(signum).name} while the ranks were starting: stopped child ranks"
        print(f"[ddp_plugins] {message} {[proc.pid for proc in procs]}; exit code {code}.", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # stderr was flushed by print
            sys.stdout.flush()
        os._exit(code)

    def _stop_children(self, stalled: str | None) -> None:
        """Stop the child ranks that still run after rank 0 failed, and say which rank failed first
        (or, for a collective that failed on rank 0, which rank stopped progressing: ``stalled``)."""
        running = _wait_then_kill(self.procs, _CHILD_GRACE_S)
        failed_first = [
            f"rank {rank} (PID {proc.pid}) {_describe_exit(proc.returncode)}"
            for rank, proc in enumerate(self.procs, 1)
            if proc not in running and proc.returncode and proc.returncode != REFUSAL_EXIT
        ]
        cause = f"{'; '.join(failed_first)} first, then rank 0 failed" if failed_first else "rank 0 failed"
        if stalled and not failed_first:
            cause += f" in a collective: {stalled.split(':')[0]}"
        stopped = [proc.pid for proc in running]
        print(f"[ddp_plugins] {cause}; stopped child ranks {stopped}.", file=sys.stderr, flush=True)

    @override
    def _call_children_scripts(self) -> None:
        """Lightning's, with ``child_command``'s command, and a parent-death signal for each child rank.

        Until :meth:`startup_done`, a child gets ``SIGKILL`` when the launcher dies: alone in the
        rendezvous it would wait out the whole timeout (docs/design.md).
        """
        self._check_can_spawn_children()
        self.procs = []  # reset in case it is called twice, as Lightning's does
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        dies_with_launcher = parent_death_signal(signal.SIGKILL)
        for local_rank in range(1, self.num_processes):
            env_copy = os.environ.copy()
            env_copy["LOCAL_RANK"] = f"{local_rank}"
            if dies_with_launcher is not None:
                env_copy[_DIES_WITH_LAUNCHER] = "1"
            command, cwd = self.child_command(local_rank)
            self.procs.append(subprocess.Popen(command, env=env_copy, cwd=cwd, preexec_fn=dies_with_launcher))


class _StartupSignals:
    """Handlers for SIGTERM and SIGINT that call ``on_signal(signum)`` in a thread of their own at once.

    While the ranks start, the main thread waits inside torch, where Python handlers do not run; a
    thread reading ``signal.set_wakeup_fd``'s pipe calls ``on_signal`` instead. :meth:`restore` gives
    back the handlers and wakeup fd. An ignored signal stays ignored; off the main thread, no-ops.
    """

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self.on_signal = on_signal
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    def install(self) -> _StartupSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        taken = tuple(sig for sig in _STARTUP_SIGNALS if signal.getsignal(sig) not in (signal.SIG_IGN, None))
        read, write = self._pipe = os.pipe()
        os.set_blocking(write, False)
        self._thread = threading.Thread(
            target=self._watch, args=(read, taken), daemon=True, name="ddp-plugins-startup-signals"
        )
        self._thread.start()
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        for sig in taken:
            self._previous[sig] = signal.signal(sig, _startup_handler)
        return self

    def restore(self) -> None:
        if self._thread is None or self._pipe is None:
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) is _startup_handler:  # not replaced by someone else meanwhile
                signal.signal(sig, previous)
        self._previous = {}
        signal.set_wakeup_fd(self._previous_fd)
        os.write(self._pipe[1], b"\0")  # not a signal number: the thread ends
        self._thread.join()
        for fd in self._pipe:
            os.close(fd)
        self._thread = self._pipe = None

    def _watch(self, read: int, taken: tuple[int, ...]) -> None:
        while True:
            for signum in os.read(read, 64):  # one byte per signal: its number
                if signum == 0:
                    return
                if signum in taken:
                    self.on_signal(signum)
                    return


def _startup_handler(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT while the ranks start: :class:`_StartupSignals`' thread acts on it."""


class CleanExitMultiprocessingLauncher(_compat.MultiProcessingLauncher):
    """Spawned children leave through :func:`exit_process` once their results are queued.

    A ``spawn``/``forkserver`` child would otherwise finalize and risk the gloo abort; ``fork``
    children already leave with ``os._exit`` (and must not run the parent's ``atexit`` handlers).
    """

    def __init__(self, *args: Any, before_launch: Callable[[Any], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.before_launch = before_launch  # the strategy's checks of the Trainer, before any child starts

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self.before_launch is not None and trainer is not None:
            self.before_launch(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        if self._start_method != "fork":
            exit_process(0)

    @override
    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        # Lightning's channel from spawned rank 0 to the caller: callbacks' results travel on it as file paths
        extra = super().get_extra_results(trainer)
        payload = {cb.spawn_results_key: cb.export_results() for cb in of_kind(trainer.callbacks, CarriesSpawnResults)}
        if payload:
            extra[_SPAWN_RESULTS_KEY] = payload
        return extra

    @override
    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        payload = extra.get(_SPAWN_RESULTS_KEY, {})
        for cb in of_kind(trainer.callbacks, CarriesSpawnResults):
            if cb.spawn_results_key in payload:
                cb.import_results(payload[cb.spawn_results_key])


def failure_tag(module: Any) -> str:
    """The tag under which the ranks whose collective failed record themselves: the global step,
    the same on every rank in one collective (a fit that failed earlier left other tags)."""
    return str(getattr(module, "global_step", ""))


def _wait_then_kill(procs: list[Any], grace_s: float) -> list[Any]:
    """Give ``procs`` ``grace_s`` seconds to exit, then kill those still running; returns them."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(proc.poll() is None for proc in procs):
        time.sleep(0.05)
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.kill()
    return running


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
