"""Preemption: signal flags, the ranks' agreement on them at a step boundary, the exit, stable run names.

By hand: Lightning's handlers checkpoint or communicate inside the handler. See docs/design.md, "Preemption".
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ddp_plugins.core.checks import ArgumentTypeError, ArgumentValueError, check_int
from ddp_plugins.core.liveness import waiting
from ddp_plugins.core.ranks import collective_device, is_distributed

__all__ = [
    "AUTO_CHECK_MAX_STEPS",
    "AUTO_CHECK_SECONDS",
    "DEFAULT_SIGNALS",
    "Preempted",
    "SignalAgreement",
    "SignalFlag",
    "agree_on_signal",
    "check_signals",
    "exit_code",
    "slurm_job_id",
    "slurm_requeue",
    "stable_run_name",
    "restart_scoped_store",
    "submitit_signal",
]

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
_INSIST_AFTER_S = 1.0  # a second Ctrl-C this long after the first ends the process at once


def exit_code(signum: int) -> int:
    """The exit code of a run stopped by ``signum``: ``128 + signum`` (143 for SIGTERM, 130 for SIGINT).

    Example::

        >>> exit_code(signal.SIGTERM), exit_code(signal.SIGINT)
        (143, 130)
    """
    return 128 + int(signum)


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is written; exits with ``128 + signum``.

    Example::

        >>> err = Preempted(signal.SIGTERM, "/tmp/ckpt")
        >>> err.code, err.signum, err.checkpoint
        (143, 15, '/tmp/ckpt')
    """

    def __init__(self, signum: int, checkpoint: str | None = None) -> None:
        super().__init__(exit_code(signum))
        self.signum, self.checkpoint = int(signum), checkpoint

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        where = f"; checkpoint {self.checkpoint}" if self.checkpoint else ""
        return f"preempted by {name} (exit code {self.code}){where}"


def check_signals(signals: Iterable[str | int]) -> tuple[signal.Signals, ...]:
    """Signal names or numbers as ``signal.Signals``; a clear error for anything else.

    Example::

        >>> check_signals(["SIGTERM", "USR1", 2])
        (<Signals.SIGTERM: 15>, <Signals.SIGUSR1: 10>, <Signals.SIGINT: 2>)
        >>> check_signals(["SIGKILL"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `signals` should be signal names ... got 'SIGKILL'.
    """
    allowed = "signal names that can be caught (such as SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP)"
    if isinstance(signals, (str, bytes)) or not isinstance(signals, Iterable):
        raise ArgumentTypeError("signals", f"a list of {allowed}", signals)
    out: dict[signal.Signals, None] = {}  # in order, each once
    for item in signals:
        try:
            if isinstance(item, bool) or not isinstance(item, (str, int)):
                raise ValueError
            if isinstance(item, int):
                sig = signal.Signals(item)
            else:
                sig = signal.Signals["SIG" + item.upper().removeprefix("SIG")]
        except (KeyError, ValueError):
            raise ArgumentValueError("signals", allowed, item) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ArgumentValueError("signals", allowed, sig.name)
        out[sig] = None
    return tuple(out)


class SignalFlag:
    """Handlers that only remember the first signal received; a second Ctrl-C a second later ends the process.

    Example::

        >>> flag = SignalFlag(["SIGUSR2"]).install()
        >>> os.kill(os.getpid(), signal.SIGUSR2)
        >>> flag.signum == signal.SIGUSR2
        True
        >>> flag.restore()
        >>> signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
        True
    """

    def __init__(
        self, signals: Iterable[str | int] = DEFAULT_SIGNALS, clock: Callable[[], float] | None = None
    ) -> None:
        self.signals = check_signals(signals)
        self.signum = 0
        self._clock = clock or time.monotonic
        self._at = 0.0
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> SignalFlag:
        """Take over the signals (main thread only; elsewhere a no-op, as signals go to the main thread)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous.setdefault(sig, signal.getsignal(sig))
                signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Give each signal back the handler it had before :meth:`install` (if ours is still there)."""
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._handle:
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            self._previous = {}

    def clear(self) -> None:
        self.signum = 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = self._clock()
        if signum == signal.SIGINT and self.signum == signum and now - self._at >= _INSIST_AFTER_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif not self.signum:
            self.signum, self._at = signum, now


def agree_on_signal(signum: int, group: Any = None) -> int:
    """The largest signal flagged on any rank (0: none): one ``all_reduce(MAX)`` every rank makes at the same point.

    Example::

        >>> agree_on_signal(0), agree_on_signal(15)
        (0, 15)
    """
    if not is_distributed():
        return int(signum)
    flag = torch.tensor([int(signum)], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


AUTO_CHECK_SECONDS = 0.5  # every="auto": SignalAgreement exchanges the stop flag about this often,
AUTO_CHECK_MAX_STEPS = 1000  # and at least every this many boundaries


class SignalAgreement:
    """The ranks' agreement on a stop flag, one async ``all_reduce(MAX)`` behind, so that no rank waits for it.

    Every rank calls the methods in the same order; ``every="auto"`` exchanges about every half second.

    Example::

        >>> agreement = SignalAgreement()
        >>> agreement.poll(0), agreement.poll(15), agreement.settle(0)
        (0, 15, 0)
    """

    def __init__(self, group: Any = None, every: int | str = 1, clock: Callable[[], float] | None = None) -> None:
        self.group = group
        self.every = check_int("every", every, 1, allowed_words=("auto",))
        self._clock = clock or time.monotonic
        self._pending: tuple[torch.Tensor, Any] | None = None
        self._boundary = 0
        self._next = 1  # the boundary of the next scheduled exchange ("auto"), set when one is read
        self._started: tuple[int, float] | None = None  # boundary and clock of the last scheduled one

    def poll(self, signum: int, start: bool = True, pace_us: int = 0) -> int:
        """The last exchange's flag (0: none); then ``signum``'s starts unless that flag stops or not ``start``."""
        if not is_distributed():
            return int(signum) if start else 0
        agreed = self._read()
        if start and not agreed:
            flag = torch.tensor([int(signum), int(pace_us)], dtype=torch.int64, device=collective_device(self.group))
            self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        return agreed

    def at_boundary(self, signum: int) -> int:
        """At a step boundary: the agreed flag of the exchange in flight (0: none); the next starts if it is due."""
        self._boundary = boundary = self._boundary + 1
        if not is_distributed():
            return int(signum)
        if self.every != "auto":
            return self.poll(signum, start=boundary % int(self.every) == 0)
        agreed = self.poll(0, start=False)  # the exchange in flight, if any, sets the next one's boundary
        if agreed or boundary < self._next:
            return agreed
        now = self._clock()
        pace_us = 0
        if self._started is not None and boundary > self._started[0]:
            pace_us = max(int((now - self._started[1]) * 1e6) // (boundary - self._started[0]), 1)
        self._started = (boundary, now)
        return self.poll(signum, start=True, pace_us=pace_us)

    def settle(self, signum: int) -> int:
        """The largest flag of the exchange in flight and of ``signum`` on every rank, waited for."""
        self._boundary += 1
        self._started, self._next = None, self._boundary + 1
        return max(self._read(), agree_on_signal(signum, self.group))

    def cancel(self) -> None:
        self._pending = None

    def _read(self) -> int:
        if self._pending is None:
            return 0
        (flag, work), self._pending = self._pending, None
        with waiting("the stop flag's all-reduce"):  # a C++ wait: torch's Python code is not on the stack
            work.wait()
        if self._started is not None:  # an "auto" exchange: the next one follows from the agreed pace
            self._next = self._started[0] + _steps_between_checks(int(flag[1].item()))
        return int(flag[0].item())


def _steps_between_checks(pace_us: int) -> int:
    """Boundaries between two ``"auto"`` exchanges (integer arithmetic: the same on every rank).

    Example::

        >>> _steps_between_checks(0), _steps_between_checks(20_000), _steps_between_checks(2_000_000)
        (1, 25, 1)
        >>> _steps_between_checks(1)
        1000
    """
    return 1 if pace_us <= 0 else max(1, min(AUTO_CHECK_MAX_STEPS, int(AUTO_CHECK_SECONDS * 1_000_000) // pace_us))


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The Slurm id of this job, ``<array job>_<task>`` for an array task; None outside Slurm.

    Example::

        >>> slurm_job_id({"SLURM_JOB_ID": "812"})
        '812'
        >>> slurm_job_id({"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "9"})
        '7_3'
        >>> slurm_job_id({}) is None
        True
    """
    env = dict(os.environ) if env is None else env
    array_job = env.get("SLURM_ARRAY_JOB_ID")
    if array_job and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{array_job}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def slurm_requeue(job_id: str | None = None) -> bool:
    """``scontrol requeue <job>`` from one rank, after the checkpoint is on disk; True when Slurm accepted it.

    Example::

        >>> slurm_requeue("not-a-job")
        False
    """
    job_id = job_id or slurm_job_id()
    if not job_id or not re.fullmatch(r"[0-9]+(_[0-9]+)?", job_id):
        log.warning("not requeued: no Slurm job id in the environment (got %r)", job_id)
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        failure = (result.stderr or result.stdout).strip() if result.returncode != 0 else None
    except (OSError, subprocess.TimeoutExpired) as err:
        failure = str(err)
    if failure is not None:
        log.warning("requeueing Slurm job %s failed: %s", job_id, failure)
        return False
    log.info("requeued Slurm job %s", job_id)
    return True


def restart_scoped_store(timeout: timedelta, env: Mapping[str, str] | None = None) -> dist.Store | None:
    """A store for this torchrun restart round alone (None outside the agent store): no dead round's addresses.

    Example::

        >>> restart_scoped_store(timedelta(seconds=30), {}) is None
        True
    """
    env = dict(os.environ) if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"ddp_plugins/restart_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def submitit_signal(env: Mapping[str, str] | None = None) -> signal.Signals | None:
    """The signal submitit sends before a time limit or preemption (``SUBMITIT_PREEMPT_SIGNAL`` or USR2), else None.

    Example::

        >>> submitit_signal({"SUBMITIT_EXECUTOR": "slurm"}), submitit_signal({})
        (<Signals.SIGUSR2: 12>, None)
    """
    env = dict(os.environ) if env is None else env
    if not env.get("SUBMITIT_EXECUTOR"):
        return None
    (sig,) = check_signals([env.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2"])
    return sig


def stable_run_name(env: Mapping[str, str] | None = None) -> str | None:
    """A run name that a restarted or requeued job finds again (torchrun's id ``none``: the agent's pid), or None.

    Example::

        >>> stable_run_name({"SLURM_JOB_ID": "812"}), stable_run_name({"TORCHELASTIC_RUN_ID": "exp1"})
        ('slurm-812', 'torchrun-exp1')
        >>> stable_run_name({}) is None
        True
    """
    env = dict(os.environ) if env is None else env
    if job := slurm_job_id(env):
        return f"slurm-{job}"
    if run_id := env.get("TORCHELASTIC_RUN_ID"):
        run_id = f"agent{os.getppid()}" if run_id == "none" else run_id
        return "torchrun-" + re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)
    return None
