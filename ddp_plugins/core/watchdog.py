"""A watchdog that names a rank that stopped progressing within a minute, whatever stopped it, and
ends the job with one line, independently of the collective timeout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ddp_plugins.core.checks import check_number
from ddp_plugins.core.files import write_text_atomic

__all__ = ["Heartbeat", "ProgressWatchdog", "Stall", "find_stall"]

_KEY = "ddp_plugins/progress/"
STALL_EXIT = 1
_MIN_GAP_S = 0.25  # the least time between two publications of one rank


class Heartbeat(NamedTuple):
    """What a rank publishes every interval: how far its training thread got, and where it is.

    Example::

        >>> Heartbeat(1, seq=3, beats=37, phase="a training step (global step 36)", pid=4242, host="n1", stack="").beats
        37
    """

    rank: int
    seq: int  # publications so far: stops advancing when the whole process stops (SIGSTOP, a kill)
    beats: int  # steps its training thread began (training, validation, test, predict), in order
    phase: str  # the last one, such as "training step 37"
    pid: int
    host: str
    stack: str  # the training thread's stack when published, innermost last


class Stall(NamedTuple):
    """A verdict: the ranks that stopped progressing, and why they count as stopped.

    Example::

        >>> Stall(ranks=(1,), frozen=True, seconds=46.0).ranks
        (1,)
    """

    ranks: tuple[int, ...]
    frozen: bool  # their process publishes nothing more (stopped or killed); else stuck with a live process
    seconds: float  # how long nothing changed


def find_stall(
    beats: Sequence[Heartbeat],
    published_at: Sequence[float],
    progressed_at: Sequence[float],
    now: float,
    after_s: float,
) -> Stall | None:
    """The verdict on a job's heartbeats, from one observer's clock (``None``: nothing to report).

    ``published_at[i]`` is when the observer last saw rank ``i``'s ``seq`` change, ``progressed_at[i]``
    when it last saw its ``beats`` change. A rank that published nothing for ``after_s`` is frozen;
    else, when no rank began a step for ``after_s``, the ranks that began fewer steps are stuck. All
    ranks at the same count is no verdict: one long step looks the same.

    Example::

        >>> beat = lambda rank, beats: Heartbeat(rank, 1, beats, f"training step {beats}", 1, "h", "")
        >>> find_stall([beat(0, 38), beat(1, 37)], [99, 99], [0, 0], now=100, after_s=45)  # rank 1's loader
        Stall(ranks=(1,), frozen=False, seconds=100)
        >>> find_stall([beat(0, 38), beat(1, 38)], [99, 99], [0, 0], now=100, after_s=45) is None  # one long step
        True
        >>> find_stall([beat(0, 38), beat(1, 37)], [99, 40], [90, 40], now=100, after_s=45)  # rank 1 stopped
        Stall(ranks=(1,), frozen=True, seconds=60)
    """
    frozen = [i for i, seen in enumerate(published_at) if now - seen > after_s]
    if frozen:
        return Stall(tuple(beats[i].rank for i in frozen), True, max(now - published_at[i] for i in frozen))
    quiet = now - max(progressed_at)
    if quiet <= after_s:
        return None
    fewest = min(beat.beats for beat in beats)
    behind = tuple(beat.rank for beat in beats if beat.beats == fewest)
    return Stall(behind, False, quiet) if len(behind) < len(beats) else None


class ProgressWatchdog:
    """Name a rank that stopped progressing within about ``after_s`` seconds, then end the job.

    The training thread calls :meth:`beat` at each step; a daemon thread publishes the rank's
    :class:`Heartbeat` to the store every ``interval_s`` and :func:`find_stall` judges everyone's.
    On a verdict the lowest progressing rank prints one line, writes the stopped ranks' stacks to
    ``dump_dir/stall.txt`` and kills them on its host, and every rank exits with :data:`STALL_EXIT`.

    Args:
        store: the process group's store.
        dump_dir: where ``stall.txt`` goes (a callable is asked at the verdict); ``None``: stderr only.
        rescue: called on the reporting rank before the job ends, while its training thread waits
            in a collective; returns what it saved (a checkpoint's path) or ``None``.
        exit: how a rank ends the job (``os._exit`` by default; a test passes its own).

    Example::

        >>> import torch.distributed as dist
        >>> watchdog = ProgressWatchdog(dist.HashStore(), rank=0, world_size=1, after_s=45)
        >>> watchdog.beat("training step 1")
        >>> watchdog.beats, watchdog.phase
        (1, 'training step 1')
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        after_s: float = 45.0,
        interval_s: float = 5.0,
        dump_dir: str | os.PathLike | Callable[[], str | os.PathLike | None] | None = None,
        rescue: Callable[[], str | None] | None = None,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.after_s = check_number("after_s", after_s, 0, exclusive_minimum=True)
        self.interval_s = check_number("interval_s", interval_s, 0, exclusive_minimum=True)
        self.dump_dir, self.rescue, self._exit = dump_dir, rescue, exit
        self.beats, self.phase = 0, "starting"
        self.stall: Stall | None = None
        self._main = threading.main_thread().ident
        self._halt, self._wake = threading.Event(), threading.Event()
        self._published = self._beat_at = 0.0
        self._thread: threading.Thread | None = None
        self._seq = 0

    def beat(self, phase: str) -> None:
        """The training thread begins a step; the watchdog's thread publishes it (at most 4 times a
        second), so the training thread never waits on the store."""
        self.beats += 1
        self.phase = phase
        self._beat_at = time.monotonic()
        if self._beat_at - self._published >= _MIN_GAP_S:
            self._wake.set()

    def start(self) -> ProgressWatchdog:
        self._thread = threading.Thread(target=self._run, name="ddp_plugins-progress-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._halt.set()
        self._wake.set()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.interval_s + 1)

    # the watchdog's thread

    def _run(self) -> None:
        judged = time.monotonic()
        last: dict[int, tuple[int, int]] = {}  # rank -> (seq, beats) last seen
        published_at, progressed_at = [judged] * self.world_size, [judged] * self.world_size
        with contextlib.suppress(Exception):
            self._publish()  # at once: a rank that stops early is known by its PID
        while not self._halt.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._halt.is_set():
                return
            try:
                self._publish()
                if time.monotonic() - judged < self.interval_s:
                    continue  # a publication the training thread asked for: the others are read on the interval
                beats = self._read()
            except Exception:  # noqa: BLE001 - the store went away with the job: nothing left to watch
                return
            now = judged = time.monotonic()
            for beat in beats:
                seq, count = last.get(beat.rank, (-1, -1))
                if beat.seq != seq:
                    published_at[beat.rank] = now
                if beat.beats != count:
                    progressed_at[beat.rank] = now
                last[beat.rank] = (beat.seq, beat.beats)
            stall = find_stall(beats, published_at, progressed_at, now, self.after_s)
            if stall is not None and not self._halt.is_set():
                self._end(stall, beats)
                return

    def _publish(self) -> None:
        self._seq += 1
        self._published = time.monotonic()
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        stack = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else ""
        beat = Heartbeat(self.rank, self._seq, self.beats, self.phase, os.getpid(), socket.gethostname(), stack)
        self.store.set(f"{_KEY}{self.rank}", json.dumps(beat._asdict()))

    def _read(self) -> list[Heartbeat]:
        """Every rank's last heartbeat; one that never published counts as not started (pid 0)."""
        return [
            Heartbeat(**json.loads(self.store.get(f"{_KEY}{rank}")))
            if self.store.check([f"{_KEY}{rank}"])
            else Heartbeat(rank, 0, 0, "not started", 0, "", "")
            for rank in range(self.world_size)
        ]

    def _end(self, stall: Stall, beats: list[Heartbeat]) -> None:
        self.stall = stall
        reporter = min(beat.rank for beat in beats if beat.rank not in stall.ranks)
        if self.rank == reporter:
            stopped = [beats[rank] for rank in stall.ranks]
            dump = _dump(stopped, stall, self.dump_dir() if callable(self.dump_dir) else self.dump_dir)
            saved = None
            if self.rescue is not None and time.monotonic() - self._beat_at > self.interval_s:
                try:  # this rank's training thread has waited a while: the state is the last step's
                    saved = self.rescue()
                except Exception as error:  # noqa: BLE001 - the job ends all the same; say why nothing was saved
                    saved = f"none written ({type(error).__name__}: {error})"
            who = ", ".join(f"rank {b.rank} (PID {b.pid} on {b.host}) after {b.phase}" for b in stopped)
            how = "its process stopped" if stall.frozen else "it stopped progressing"
            resume = f"Checkpoint of the last completed step: {saved}" if saved else "The run resumes from its newest"
            print(
                f"error: {who}: {how} {stall.seconds:.0f} s ago, and the job waited for it;"
                f" ending every rank{f' (its stack: {dump})' if dump else ''}. {resume};"
                " a rank that may legitimately pause longer needs strategy.stall_timeout raised.",
                file=sys.stderr,
                flush=True,
            )
            host = socket.gethostname()
            for beat in stopped:
                if beat.host == host and beat.pid not in (0, os.getpid()):
                    with contextlib.suppress(OSError):
                        os.kill(beat.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):  # the others also leave when the store goes
                self.store.set(f"{_KEY}verdict", "1")
        else:
            # the reporter's line first: a rank that left earlier would fail the reporter's collective
            deadline = time.monotonic() + 2 * self.interval_s
            with contextlib.suppress(Exception):  # the store left with the reporter
                while not self.store.check([f"{_KEY}verdict"]) and time.monotonic() < deadline:
                    time.sleep(0.2)
        self._exit(STALL_EXIT)


def _dump(stopped: list[Heartbeat], stall: Stall, folder: str | os.PathLike | None) -> str | None:
    """Write the stopped ranks' last heartbeats, stacks included, to ``folder/stall.txt``."""
    if folder is None:
        return None
    lines = [f"stalled ranks {list(stall.ranks)} ({'frozen' if stall.frozen else 'stuck'}, {stall.seconds:.0f} s)"]
    for beat in stopped:
        lines += [f"\nrank {beat.rank} (PID {beat.pid} on {beat.host}), last: {beat.phase}", beat.stack]
    path = Path(folder) / "stall.txt"
    try:
        write_text_atomic(path, "\n".join(lines))
    except OSError:
        return None
    return str(path)
