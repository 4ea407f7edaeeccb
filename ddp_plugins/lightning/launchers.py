"""The strategy's launchers: watched child ranks, no orphans; see docs/design.md, "When a rank fails or stops"."""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import IO, Any, NamedTuple, NoReturn

import torch.distributed as dist
from typing_extensions import override

from ddp_plugins import _compat
from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.core.preemption import Preempted
from ddp_plugins.core.process import exit_process, parent_death_signal
from ddp_plugins.lightning.contracts import CarriesSpawnResults, of_kind
from ddp_plugins.lightning.resume import ResumeMismatch

__all__ = [
    "REFUSAL_EXIT",
    "ChildCommand",
    "CleanExitMultiprocessingLauncher",
    "JobSubprocessLauncher",
    "end_launched_job",
    "leave_ended_job",
]

_CHILD_GRACE_S = 2.0  # for a child rank to exit on its own once rank 0 failed, before it is killed
_PREEMPT_GRACE_S = 30.0  # children of a preempted run only tear down and exit
_STARTUP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_WATCH_S = 1.0  # how often the rank watcher looks at the child ranks
_STARTUP_GRACE_S = 3.0  # for rank 0 to end its start-up alike after a child rank refused or exited 0
_DRAIN_S = 1.0  # seconds to wait for the last stderr bytes of a child rank that exited
_TAIL_BYTES = 4096  # the end of a child rank's start-up stderr kept for its last line
_REFUSAL_PREFIX = "error: "  # the app's "error: <key> ..., allowed: ..."
# JSON in a child rank's environment, undone after start-up: "dies_with_launcher", "stderr" (an fd to take back)
_CHILD_STARTUP = "DDP_PLUGINS_CHILD_STARTUP"
_SPAWN_RESULTS_KEY = "ddp_plugins.spawn_results"  # callbacks' results, from spawned rank 0
ChildCommand = Callable[[int], tuple[list[str], str | None]]  # local rank -> (command, working folder)
_JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
_launched: dict[str, Any] | None = None  # the job this process started child ranks for: job, before, set

REFUSAL_EXIT = 2
"""Exit code of a rank that refused its job in one line (every rank alike, rank 0 prints it): no crash. At
start-up a child's exit 2 is one only with an ``error: ...`` last stderr line (Python's own exit 2 fails)."""


def _agreed_code(code: int | None) -> bool:
    """An exit every rank reaches alike (:class:`Preempted`'s 128 + signal, or a refusal): rank 0 ends the same way."""
    return code is not None and (128 < code < 128 + signal.NSIG or code == REFUSAL_EXIT)


class _Ending(NamedTuple):
    """A child rank's exit that ends the job: the launcher's line, and how this process ends."""

    line: str
    code: int | None  # this process's exit code; None: it kills itself, as it killed the child ranks


_DONE = "done"  # an observer's state: nothing more to watch (every child rank ended, or agreed to stop)


class _StartupObserver:
    """While the ranks start, any child exit ends the job; a refusal or exit 0 after :data:`_STARTUP_GRACE_S`."""

    def __init__(self, procs: list[Any], tees: list[_StderrTee | None]) -> None:
        self._procs, self._tees = procs, tees
        self._seen: dict[int, float] = {}  # rank: when its exit was first seen
        self._lines: dict[int, str] = {}  # rank: its last start-up stderr line, read once it exited

    def check(self, codes: list[int | None]) -> _Ending | None:
        """The ending the child ranks' exit ``codes`` call for, or ``None`` (watch on)."""
        for rank, code in enumerate(codes, 1):
            if code is not None and (ending := self._exited(rank, code)) is not None:
                return ending
        return None

    def _exited(self, rank: int, code: int) -> _Ending | None:
        seen_at = self._seen.setdefault(rank, time.monotonic())
        if rank not in self._lines:
            tee = self._tees[rank - 1]
            self._lines[rank] = tee.last_line(_DRAIN_S) if tee is not None else ""
        line = self._lines[rank]
        refused = code == REFUSAL_EXIT and line.startswith(_REFUSAL_PREFIX)
        if (refused or code == 0) and time.monotonic() - seen_at < _STARTUP_GRACE_S:
            return None
        how = f"{_describe_exit(code)}{' (a refusal)' if refused else ''} while the ranks were starting"
        said = f"its last stderr line: {line}" if line else "it wrote nothing to stderr"
        pid = self._procs[rank - 1].pid
        return _Ending(f"rank {rank} (PID {pid}) {how}; stopped every rank; {said}", REFUSAL_EXIT if refused else 1)


class _ExitObserver:
    """After start-up, where no liveness room watches: a failure (not 0 nor :func:`_agreed_code`) ends the job."""

    def __init__(self, procs: list[Any]) -> None:
        self._procs = procs

    def check(self, codes: list[int | None]) -> _Ending | str | None:
        """The ending the exit ``codes`` call for, :data:`_DONE`, or ``None`` (watch on)."""
        if all(code == 0 or _agreed_code(code) for code in codes):
            return _DONE  # every child ended, or stopped for a preemption signal or refused: rank 0 does the same
        for rank, code in enumerate(codes, 1):
            if code and not _agreed_code(code):
                pid = self._procs[rank - 1].pid
                return _Ending(f"rank {rank} (PID {pid}) {_describe_exit(code)}; stopping every rank.", None)
        return None


def _terminate(procs: list[Any], ending: _Ending) -> NoReturn:
    """Say the line, kill every child rank, then this process: SIGKILL, or ``os._exit`` (main may be in rendezvous)."""
    print(f"[ddp_plugins] {ending.line}", file=sys.stderr, flush=True)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    if ending.code is None:
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(ending.code if ending.code is not None else 1)


class _RankWatcher(threading.Thread):
    """Watch the child ranks (:class:`_StartupObserver`, then :class:`_ExitObserver`), end the job at an ending.

    Unlike Lightning's ``_ChildProcessObserver`` (INFO level, usually hidden), it can be stopped."""

    def __init__(
        self,
        procs: list[Any],
        tees: list[_StderrTee | None],
        halt: threading.Event,
        ranks_met: threading.Event,
        after_startup: bool,
    ) -> None:
        super().__init__(daemon=True, name="ddp-plugins-rank-watcher")
        self.procs = procs
        self._halt, self._ranks_met = halt, ranks_met
        self._startup = _StartupObserver(procs, tees)
        self._after = _ExitObserver(procs) if after_startup else None

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()

    @override
    def run(self) -> None:
        while not self._halt.wait(_WATCH_S):
            codes = [proc.poll() for proc in self.procs]
            state: _Ending | str | None
            if not self._ranks_met.is_set():
                state = self._startup.check(codes)
            elif self._after is not None:
                state = self._after.check(codes)
            else:
                return
            if state == _DONE:
                return
            if isinstance(state, _Ending) and not self._halt.is_set():  # else the launcher stops the ranks itself
                _terminate(self.procs, state)


class _StderrTee(threading.Thread):
    """Pass a child rank's start-up stderr on to the launcher's, keeping the last line (then the child writes
    there directly: :meth:`JobSubprocessLauncher.startup_done`; a pipe would break if it outlives us)."""

    def __init__(self, source: IO[bytes], target: int) -> None:
        super().__init__(daemon=True, name="ddp-plugins-stderr-tee")
        self._source = source
        self._target = target  # the launcher's stderr as the child rank got it (a duplicate of fd 2)
        self._tail = b""

    @override
    def run(self) -> None:
        try:
            while chunk := os.read(self._source.fileno(), 65536):
                self._tail = (self._tail + chunk)[-_TAIL_BYTES:]
                with contextlib.suppress(OSError):  # a closed stderr must not block the child rank
                    while chunk:
                        chunk = chunk[os.write(self._target, chunk) :]
        finally:
            os.close(self._target)
            self._source.close()

    def last_line(self, wait_s: float) -> str:
        """The last non-blank start-up stderr line, after up to ``wait_s`` (a DataLoader worker may hold the pipe)."""
        self.join(wait_s)
        lines = [line.strip() for line in self._tail.decode(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else ""


class JobSubprocessLauncher(_compat.SubprocessScriptLauncher):
    """Lightning's subprocess launcher with a rank watcher, and no orphans.

    ``child_command(local_rank)`` gives each child rank's command and working folder (default: Lightning's
    re-run of this command line). Children stop when rank 0 raises anything, not only ``KeyboardInterrupt``."""

    def __init__(
        self,
        *args: Any,
        before_launch: Callable[[Any, dict[str, Any]], None] | None = None,
        child_command: ChildCommand | None = None,
        watch_after_startup: bool = True,
        on_failure: Callable[[BaseException], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.on_failure = on_failure  # told of rank 0's error before the child ranks are stopped
        self.watch_after_startup = watch_after_startup  # False where a liveness room names a failed rank
        self.before_launch = before_launch  # the strategy's checks of the Trainer, before any child starts
        self.child_command = child_command or _compat.subprocess_cmd  # default: Lightning's command
        self._reruns_command_line = child_command is None
        self._tees: list[_StderrTee | None] = []  # each child rank's stderr while it starts
        self._startup: _StartupSignals | None = None  # SIGTERM and SIGINT held while the ranks start
        self._halt: threading.Event | None = None  # set: the rank watcher stops
        self._ranks_met: threading.Event | None = None  # set: the start-up is done

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self.before_launch is not None and trainer is not None:
            self.before_launch(trainer, _launch_arguments(function, args, kwargs))
        starts_children = not self.cluster_environment.creates_processes_externally and self.num_processes > 1
        if starts_children and self._reruns_command_line:
            self._check_can_spawn_children()  # Lightning's refusal of a child rank that would start ranks, first
            _check_rerunnable(*self.child_command(1))
        watcher = None
        try:
            if not self.cluster_environment.creates_processes_externally:
                self._halt, self._ranks_met = threading.Event(), threading.Event()
                self._startup = _StartupSignals(self._stop_startup).install()
                self._call_children_scripts()
                for tee in self._tees:
                    if tee is not None:
                        tee.start()
                watcher = _RankWatcher(self.procs, self._tees, self._halt, self._ranks_met, self.watch_after_startup)
                watcher.start()
            _compat.set_num_threads_if_needed(self.num_processes)
            return function(*args, **kwargs)
        except BaseException as error:
            if watcher is None:
                raise
            watcher.stop()
            if self.on_failure is not None:  # may end the job here, naming the rank that caused it
                self.on_failure(error)
            if isinstance(error, (Preempted, ResumeMismatch)):
                # every rank stops at this step or refuses the resume alike: let the children finish
                _wait_then_kill(self.procs, _PREEMPT_GRACE_S)
            else:
                self._stop_children()
            raise
        finally:
            self.startup_done()  # a start-up that failed gives the handlers back all the same
            if watcher is not None:  # no thread outlives fit (stopping twice is harmless)
                watcher.stop()

    def startup_done(self) -> None:
        """The ranks have met: give back the signal handlers; a child clears its parent-death signal, takes stderr."""
        if self._ranks_met is not None:
            self._ranks_met.set()
        if self._startup is not None:
            self._startup.restore()
            self._startup = None
        told = json.loads(os.environ.pop(_CHILD_STARTUP, "{}"))
        if told.get("dies_with_launcher"):
            clear = parent_death_signal(0)
            if clear is not None:
                clear()
        stderr = told.get("stderr")
        if stderr is not None:
            with contextlib.suppress(Exception):  # sys.stderr may be anything by now
                sys.stderr.flush()
            with contextlib.suppress(OSError, ValueError):
                os.dup2(int(stderr), 2)
                os.close(int(stderr))

    def speaks_for(self, pids: Iterable[int]) -> bool:
        """Whether the watcher ends the job for these (starting) child ranks' exit: its line has their stderr."""
        if self._ranks_met is None or self._ranks_met.is_set():
            return False
        children = {proc.pid for proc in self.procs}
        pids = list(pids)
        return bool(pids) and all(pid in children for pid in pids)

    def _stop_startup(self, signum: int) -> None:
        """SIGTERM/SIGINT at start-up: forward it, kill children left, ``os._exit(128 + signal)`` (no atexit waits)."""
        if self._halt is not None:
            self._halt.set()  # the rank watcher must not take the children's exit for a failure
        procs = list(self.procs)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)
        _wait_then_kill(procs, _CHILD_GRACE_S)
        _drain(self._tees)
        code = 128 + signum
        message = f"{signal.Signals(signum).name} while the ranks were starting: stopped child ranks"
        print(f"[ddp_plugins] {message} {[proc.pid for proc in procs]}; exit code {code}.", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # stderr was flushed by print
            sys.stdout.flush()
        os._exit(code)

    def _stop_children(self) -> None:
        """Stop the child ranks that still run after rank 0 failed, and say which rank failed first."""
        running = _wait_then_kill(self.procs, _CHILD_GRACE_S)
        _drain(self._tees)
        failed = [
            (rank, proc)
            for rank, proc in enumerate(self.procs, 1)
            if proc not in running and proc.returncode and proc.returncode != REFUSAL_EXIT
        ]
        cause = "; ".join(f"rank {rank} (PID {proc.pid}) {_describe_exit(proc.returncode)}" for rank, proc in failed)
        cause = f"{cause} first, then rank 0 failed" if failed else "rank 0 failed"
        stopped = [proc.pid for proc in running]
        said = "."
        if failed and not (self._ranks_met and self._ranks_met.is_set()):  # it still wrote through this process
            tee = dict(zip(self.procs, self._tees, strict=False)).get(failed[0][1])
            line = tee.last_line(0.0) if tee is not None else ""
            said = f"; its last stderr line: {line}" if line else said
        print(f"[ddp_plugins] {cause}; stopped child ranks {stopped}{said}", file=sys.stderr, flush=True)

    @override
    def _call_children_scripts(self) -> None:
        """Lightning's, with ``child_command``'s command, a parent-death signal and a stderr pipe per child rank.

        Until :meth:`startup_done` an orphan dies: alone in the rendezvous it would wait out the whole timeout."""
        global _launched
        self._check_can_spawn_children()
        self.procs, self._tees = [], []  # reset in case it is called twice, as Lightning's does
        before = {key: os.environ.get(key) for key in _JOB_VARIABLES}
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        job = _hydra_job()
        if job is not None:  # the next Hydra job of this process ends this one's group (leave_ended_job)
            _launched = {"job": job, "before": before, "set": {key: os.environ[key] for key in _JOB_VARIABLES}}
        dies_with_launcher = parent_death_signal(signal.SIGKILL)
        for local_rank in range(1, self.num_processes):
            env_copy = os.environ.copy()
            env_copy["LOCAL_RANK"] = f"{local_rank}"
            told: dict[str, Any] = {"dies_with_launcher": dies_with_launcher is not None}
            command, cwd = self.child_command(local_rank)
            try:
                stderr = os.dup(2)  # the launcher's stderr, for the tee to write to and the child to take back
            except OSError:  # none to pass on
                env_copy[_CHILD_STARTUP] = json.dumps(told)
                self.procs.append(subprocess.Popen(command, env=env_copy, cwd=cwd, preexec_fn=dies_with_launcher))
                self._tees.append(None)
                continue
            env_copy[_CHILD_STARTUP] = json.dumps({**told, "stderr": stderr})
            try:
                proc = subprocess.Popen(
                    command, env=env_copy, cwd=cwd, preexec_fn=dies_with_launcher,
                    stderr=subprocess.PIPE, pass_fds=(stderr,),
                )  # fmt: skip
            except BaseException:
                os.close(stderr)
                raise
            self.procs.append(proc)
            self._tees.append(_StderrTee(proc.stderr, stderr) if proc.stderr is not None else None)


def _hydra_job() -> tuple[str, int] | None:
    """This process's Hydra job (output folder, sweep number), ``None`` outside Hydra (not imported for it)."""
    module = sys.modules.get("hydra.core.hydra_config")
    if module is None or not module.HydraConfig.initialized():
        return None
    config = module.HydraConfig.get()
    return str(config.runtime.output_dir), int(config.job.get("num") or 0)


def end_launched_job() -> None:
    """Leave this process as a sweep's next job expects: no process group, the launch variables undone.

    The group is freed after a ``gc`` of the DDP reducer, which would join gloo's threads with the GIL held."""
    global _launched
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
    if _launched is not None:
        for key, value in _launched["before"].items():
            if os.environ.get(key) != _launched["set"][key]:
                continue  # changed since the launch: not the launcher's to restore
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
    _launched = None


def leave_ended_job() -> None:
    """In a new Hydra job, end an earlier job's group and launch variables (:func:`end_launched_job`).

    Lightning keeps both after ``fit``: the next job reused a group whose child had exited. Kept within a job."""
    if _launched is not None and _hydra_job() != _launched["job"]:
        end_launched_job()


class _StartupSignals:
    """SIGTERM/SIGINT handlers whose thread, reading the wakeup fd's pipe, calls ``on_signal(signum)`` at once.

    At start-up the main thread waits inside torch, where Python handlers do not run. Off the main thread: no-op."""

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
    """Spawned children leave through :func:`exit_process` once their results are queued (no gloo abort).

    ``fork`` children already leave with ``os._exit`` (and must not run the parent's ``atexit`` handlers)."""

    def __init__(
        self, *args: Any, before_launch: Callable[[Any, dict[str, Any]], None] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.before_launch = before_launch

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self.before_launch is not None and trainer is not None:
            self.before_launch(trainer, _launch_arguments(function, args, kwargs))
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


def _launch_arguments(function: Callable, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The launched function's arguments by name (``fit``'s ``train_dataloaders``), ``{}`` where they do not bind."""
    try:
        return dict(inspect.signature(function).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {}


def _check_rerunnable(command: list[str], cwd: str | None) -> None:
    """Refuse a child command re-running a script that cannot be given again (``python -c``, ``-``, not a file)."""
    if len(command) > 1 and command[1] == "-m":
        return  # a module: found again by name
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 in ("-c", "-"):
        problem = (
            "got '-c' (`python -c` keeps no copy of its code for a child rank)"
            if argv0 == "-c"
            else "got '-' (`python -` reads the script from stdin, which no child rank can read again)"
        )
    else:
        script = command[1] if len(command) > 1 else ""
        if os.path.isfile(os.path.join(cwd or os.getcwd(), script)):
            return
        problem = f"got {argv0!r}, and {script!r} is not a file"
    raise ArgumentValueError(
        "sys.argv[0]",
        "a script file that each child rank re-runs",
        problem=problem,
        hint=(
            "Save the script to a file and run `python file.py`, run it as a module (`python -m package.module`),"
            " start the ranks with torchrun, or use strategy='ddp_plugins_notebook' (forked ranks: nothing re-run)."
        ),
    )


def _drain(tees: list[_StderrTee | None], seconds: float = _DRAIN_S) -> None:
    """Wait up to ``seconds`` in all for the child ranks' start-up stderr to be passed on."""
    deadline = time.monotonic() + seconds
    for tee in tees:
        if tee is not None and tee.ident is not None:
            tee.join(max(0.0, deadline - time.monotonic()))


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
