"""Launchers of the DDP strategy
==============================

* :class:`_JobSubprocessLauncher` (``start_method="popen"``): Lightning's subprocess launcher with
  job-scoped child commands (under Hydra ``--multirun`` a child rank re-runs *its* job, not the
  sweep), a rank watcher that names a failed rank and stops every rank, and no orphans when
  rank 0 raises.
* :class:`_CleanExitMultiprocessingLauncher` (``spawn``, ``fork``, ``forkserver``): spawned
  children leave through :func:`ddp_plugins.core.exit_process`, and SequentialEvaluation's results
  travel back to the calling process.

Both subclass Lightning's launchers (private classes, see :mod:`ddp_plugins._compat`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from ddp_plugins import _compat
from ddp_plugins.core.preemption import Preempted
from ddp_plugins.core.process import exit_process
from ddp_plugins.core.stalls import describe_collective_failure
from ddp_plugins.lightning.sequential_evaluation import SequentialEvaluation

__all__ = ["split_config_flags"]

# Seconds a child rank gets to exit on its own once rank 0 failed, before it is killed.
_CHILD_GRACE_S = 2.0
_PREEMPT_GRACE_S = 30.0  # children of a preempted run only tear down and exit
_RESULTS_KEY = "ddp_plugins.sequential_evaluation"
_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def split_config_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split Hydra's config-selection flags (``--config-name x``, ``-cd=x``, ...) from the rest.

    Returns:
        The flags, each as ``[flag, value]`` pairs flattened, and every other argument.

    Example::

        >>> split_config_flags(["--config-name", "mine", "backend=gloo", "-cd=/etc/conf"])
        (['--config-name', 'mine', '-cd', '/etc/conf'], ['backend=gloo'])
    """
    flags: list[str] = []
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        name, has_value, value = arg.partition("=")
        if name in _CONFIG_FLAGS:
            flags += [name, value if has_value else next(args, "")]
        else:
            rest.append(arg)
    return flags, rest


def _hydra_quote(value: str) -> str:
    """``value`` as a single-quoted Hydra override value, so quotes and spaces in a path survive.

    Example::

        >>> print(_hydra_quote('runs/we"ird'))
        'runs/we"ird'
    """
    return "'" + value.replace("'", "\\'") + "'"


def _job_subprocess_cmd(local_rank: int) -> tuple[list[str], str | None]:
    """The command that starts child rank ``local_rank`` of the current (Hydra) job."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return list(_compat.basic_subprocess_cmd()), None

    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hydra_cfg = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    # The config the user chose, only this job's overrides (no --multirun, no sweep), and this
    # job's own output folder.
    command += split_config_flags(sys.argv[1:])[0]
    command += list(hydra_cfg.overrides.task)
    command += [
        f"hydra.run.dir={_hydra_quote(hydra_cfg.runtime.output_dir)}",
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
    ]
    return command, get_original_cwd()


def _preempted_code(code: int | None) -> bool:
    """An exit code of :class:`Preempted` (128 + a signal number): a child that stopped on agreement."""
    return code is not None and 128 < code < 128 + signal.NSIG


class _RankWatcher(threading.Thread):
    """Watches the child ranks; when one fails, says which and how, and stops every rank.

    Lightning's ``_ChildProcessObserver`` does the same every 5 s but reports at INFO level,
    which is usually hidden; this one prints to stderr, names the signal, and can be stopped
    (when rank 0 itself failed and stops its children).
    """

    def __init__(self, procs: list[Any], period: float = 1.0) -> None:
        super().__init__(daemon=True, name="ddp-plugins-rank-watcher")
        self.procs = procs
        self.period = period
        self._halt = threading.Event()

    def stop(self) -> None:
        """Stop watching and wait for the thread to end (it checks every ``period`` seconds)."""
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()

    @override
    def run(self) -> None:
        while not self._halt.wait(self.period):
            codes = [proc.poll() for proc in self.procs]
            if all(code == 0 for code in codes):
                return
            if all(code == 0 or _preempted_code(code) for code in codes):
                return  # every child stopped for a preemption signal: rank 0 stops at the same step
            failed = [
                (rank, proc, code)
                for rank, (proc, code) in enumerate(zip(self.procs, codes, strict=True), 1)
                if code and not _preempted_code(code)
            ]
            if failed and not self._halt.is_set():
                rank, proc, code = failed[0]
                print(
                    f"[ddp_plugins] rank {rank} (PID {proc.pid}) {_describe_exit(code)}; stopping every rank.",
                    file=sys.stderr,
                    flush=True,
                )
                for other in self.procs:
                    if other.poll() is None:
                        other.send_signal(signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)


class _JobSubprocessLauncher(_compat.SubprocessScriptLauncher):
    """Lightning's subprocess launcher: job-scoped child commands, a rank watcher, no orphans.

    ``_call_children_scripts`` is Lightning's body with the command from
    :func:`_job_subprocess_cmd` (Lightning builds it inline, so the method is restated);
    ``launch`` is Lightning's with :class:`_RankWatcher` instead of its observer, and stops the
    child ranks when rank 0 raises (Lightning only does so for ``KeyboardInterrupt``, leaving
    them blocked in a collective until the timeout).
    """

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        watcher = None
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            watcher = _RankWatcher(self.procs)
            watcher.start()
        _compat.set_num_threads_if_needed(self.num_processes)
        try:
            return function(*args, **kwargs)
        except Preempted:
            # every rank agreed to stop at this step and wrote its part: let the children finish
            if watcher is not None:
                watcher.stop()
                watcher = None
                self._wait_children()
            raise
        except BaseException as error:
            if watcher is not None:
                watcher.stop()
                watcher = None
                # which rank stopped, asked before the children are stopped (then they cannot answer)
                module = trainer.lightning_module if trainer is not None else None
                self._stop_children(describe_collective_failure(error, tag=_failure_tag(module)))
            raise
        finally:
            if watcher is not None:  # fit returned: no thread outlives it
                watcher.stop()

    def _wait_children(self) -> None:
        deadline = time.monotonic() + _PREEMPT_GRACE_S
        while time.monotonic() < deadline and any(proc.poll() is None for proc in self.procs):
            time.sleep(0.05)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)

    def _stop_children(self, stalled: str | None = None) -> None:
        """Stop the child ranks that still run after rank 0 failed, and say which rank failed first
        (or, for a collective that failed on rank 0, which rank stopped progressing: ``stalled``)."""
        deadline = time.monotonic() + _CHILD_GRACE_S
        while time.monotonic() < deadline and any(proc.poll() is None for proc in self.procs):
            time.sleep(0.1)
        running = [proc for proc in self.procs if proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGKILL)
        failed_first = [
            f"rank {rank} (PID {proc.pid}) {_describe_exit(proc.returncode)}"
            for rank, proc in enumerate(self.procs, 1)
            if proc not in running and proc.returncode
        ]
        cause = f"{'; '.join(failed_first)} first, then rank 0 failed" if failed_first else "rank 0 failed"
        if stalled and not failed_first:
            cause += f" in a collective: {stalled.split(':')[0]}"
        print(
            f"[ddp_plugins] {cause}; stopped child ranks {[proc.pid for proc in running]}.",
            file=sys.stderr,
            flush=True,
        )

    @override
    def _call_children_scripts(self) -> None:
        import subprocess

        self._check_can_spawn_children()
        self.procs = []  # reset in case it is called twice, as Lightning's does
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            env_copy = os.environ.copy()
            env_copy["LOCAL_RANK"] = f"{local_rank}"
            if os.environ.get("PL_GLOBAL_SEED") is None and "PL_GLOBAL_SEED" in env_copy:
                del env_copy["PL_GLOBAL_SEED"]
            command, cwd = _job_subprocess_cmd(local_rank)
            self.procs.append(subprocess.Popen(command, env=env_copy, cwd=cwd))


class _CleanExitMultiprocessingLauncher(_compat.MultiProcessingLauncher):
    """Spawned children leave through :func:`exit_process` once their results are queued.

    A ``spawn``/``forkserver`` child is a fresh interpreter that would otherwise finalize and risk
    the gloo abort; ``fork`` children already leave with ``os._exit`` (and must not run the
    parent's ``atexit`` handlers), so they are left as they are. A failing child is handled by
    torch's ``ProcessContext.join``: it stops the others and raises with the child's traceback.
    """

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        if self._start_method != "fork":
            exit_process(0)

    @override
    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        # Lightning's channel from spawned rank 0 to the calling process (it carries
        # `callback_metrics`); SequentialEvaluation's results travel on it as file paths
        extra = super().get_extra_results(trainer)
        payload = {cb._uid: cb._export() for cb in trainer.callbacks if isinstance(cb, SequentialEvaluation)}
        if payload:
            extra[_RESULTS_KEY] = payload
        return extra

    @override
    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        payload = extra.get(_RESULTS_KEY, {})
        for cb in trainer.callbacks:
            if isinstance(cb, SequentialEvaluation) and cb._uid in payload:
                cb._import(payload[cb._uid])


def _failure_tag(module: Any) -> str:
    """The tag under which the ranks whose collective failed record themselves: the global step,
    the same on every rank in one collective (a fit that failed earlier left other tags)."""
    return str(getattr(module, "global_step", ""))


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
