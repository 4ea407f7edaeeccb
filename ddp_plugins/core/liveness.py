"""One liveness room per job: a progress record per rank, one judge, a stall named, then ended.

By hand: a collective's timeout names no rank. See docs/design.md, "When a rank fails or stops"."""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ddp_plugins.core.checks import ArgumentValueError, check_number
from ddp_plugins.core.files import write_text_atomic

__all__ = [
    "STALL_EXIT",
    "Liveness",
    "RankState",
    "Record",
    "RendezvousError",
    "Verdict",
    "judge",
    "process_state",
    "rendezvous_error",
    "waiting",
]

STALL_EXIT = 1
_room: Liveness | None = None  # this process's running room (`waiting` marks in it)
_KEY = "ddp_plugins/liveness/"
_VERDICT, _LEFT = f"{_KEY}verdict", f"{_KEY}left"
_ASKS, _ANSWER = f"{_KEY}asks", f"{_KEY}answer/"  # failed collectives asked about; the observer's answers
_NEVER = float("-inf")
_LIVE = frozenset({"behind", "silent", "busy"})  # verdicts on a rank whose process may be running
# ended at end_after_s by default: stopped or gone, or a silent store (its C++ thread answers while Python is busy)
_PROVEN = frozenset({"gone", "stopped", "store"})
_NAMING_S = 5.0  # the most a failed collective's rank waits for its room's thread to say the line it began
_HOW = {
    "gone": "its process is gone (killed or exited)",
    "stopped": "its process is stopped (SIGSTOP or a debugger)",
    "busy": "its process runs but publishes nothing (a C call holding Python's GIL)",
    "silent": "it publishes nothing (stopped, killed or holding the GIL: another host, not told apart)",
    "behind": "it stopped progressing while the other ranks wait for it",
    "store": "the job's store (hosted there) does not answer",
    "raised": "it raised an error (its own traceback says where)",
}


class RankState(str, enum.Enum):
    """Where a rank is in its life, as its record says: judged while running, no more once it left or raised."""

    RUNNING = "running"
    LEFT = "left"  # its fit ended
    RAISED = "raised"  # it raised an error: its own traceback says where


class Record(NamedTuple):
    """What a rank publishes: publications so far (``seq``), phase boundaries passed (``marks``), where it is.

    Example::

        >>> Record(1, seq=3, marks=37, phase="a training step (global step 18)", pid=4242, host="n1").marks
        37
    """

    rank: int
    seq: int
    marks: int
    phase: str
    pid: int
    host: str
    stack: str = ""  # the training thread's stack when published, innermost last
    pid_ns: str = ""  # its PID namespace: a PID is seen in this host's /proc only from the same one
    waits: bool = False  # the training thread waits in a collective (marked so, or torch.distributed's code)
    state: str = RankState.RUNNING.value  # a RankState's value (the record travels as JSON)


class Ask(NamedTuple):
    """A rank's question to the observer when its collective failed: did it wait in one, for about the timeout."""

    rank: int
    waits: bool
    timed_out: bool


class Verdict(NamedTuple):
    """The ranks that stopped, how (a key of the judge's kinds) and for how long.

    Example::

        >>> records = [Record(0, 9, 9, "a backward", 10, "n1"), Record(1, 4, 8, "a step", 11, "n1")]
        >>> Verdict((1,), "stopped", 31.0).line(records)
        'rank 1 (PID 11 on n1, a step): its process is stopped (SIGSTOP or a debugger) for 31 s'
    """

    ranks: tuple[int, ...]
    how: str
    seconds: float

    def line(self, records: Sequence[Record]) -> str:
        """One line naming the ranks (``records`` by rank)."""
        who = ", ".join(f"rank {r} ({_where(records[r])})" for r in self.ranks)
        return f"{who}: {_HOW[self.how]}" + (f" for {self.seconds:.0f} s" if self.seconds else "")


class RendezvousError(RuntimeError):
    """The ranks did not all meet to make the process group; ``str()`` is one line."""


def rendezvous_error(
    error: BaseException, address: str, port: int, world_size: int, timeout_s: float
) -> RendezvousError:
    """A one-line :class:`RendezvousError` for a store or network error raised while the group is made.

    Example::

        >>> err = RuntimeError("Timed out after 16 seconds waiting for clients. 2/4 clients joined.")
        >>> print(rendezvous_error(err, "127.0.0.1", 29500, 4, 15))  # doctest: +ELLIPSIS
        the 4 ranks did not all meet at 127.0.0.1:29500 within the timeout (15 s): Timed out after 16 seconds ...
    """
    return RendezvousError(
        f"the {world_size} ranks did not all meet at {address}:{port} within the timeout ({timeout_s:g} s):"
        f" {_first_line(error)} Check that every node started and can reach that address."
    )


def judge(
    records: Sequence[Record],
    seen_at: Sequence[float],
    progressed_at: Sequence[float],
    now: float,
    after_s: float,
    states: Sequence[str | None] = (),
) -> Verdict | None:
    """The verdict on the ranks' records (``None``: nothing to name), from one observer's clock.

    ``seen_at[r]`` / ``progressed_at[r]``: when rank ``r``'s ``seq`` / ``marks`` last changed; ``states[r]``: its
    :func:`process_state`, where visible. The rules: docs/design.md, "When a rank fails or stops".

    Example::

        >>> rec = lambda rank, marks: Record(rank, 1, marks, f"training step {marks}", 1, "h")
        >>> judge([rec(0, 38), rec(1, 37)], [99, 99], [0, 0], now=100, after_s=30)  # rank 1 stuck in its step
        Verdict(ranks=(1,), how='behind', seconds=100)
        >>> judge([rec(0, 38), rec(1, 38)], [99, 99], [0, 0], now=100, after_s=30) is None  # one long step
        True
        >>> judge([rec(0, 38)._replace(waits=True), rec(1, 38)], [99, 99], [0, 0], now=100, after_s=30)
        Verdict(ranks=(1,), how='behind', seconds=100)
        >>> judge([rec(0, 38), rec(1, 37)], [99, 40], [90, 40], now=100, after_s=30, states=[None, "stopped"])
        Verdict(ranks=(1,), how='stopped', seconds=60)
        >>> judge([rec(0, 38), rec(1, 37)], [99, 99], [99, 99], now=100, after_s=30, states=[None, "gone"])
        Verdict(ranks=(1,), how='gone', seconds=1)
    """
    records = [r for r in records if not _left(r)]  # a rank that left (its fit ended, or it raised): judged no more
    if not records:
        return None
    state = list(states) + [None] * (max(r.rank for r in records) + 1 - len(states))
    gone = [r.rank for r in records if state[r.rank] == "gone"]
    for ranks in (gone, [r.rank for r in records if now - seen_at[r.rank] > after_s]):
        if ranks:
            how = {state[r] or "silent" for r in ranks}
            seconds = max(now - seen_at[r] for r in ranks)
            return Verdict(tuple(ranks), how.pop() if len(how) == 1 else "silent", seconds)
    fewest = min(r.marks for r in records)
    behind = tuple(r.rank for r in records if r.marks == fewest)
    waiting = [r.rank for r in records if r.waits]
    if len(behind) == len(records) and fewest and 0 < len(waiting) < len(records):
        # the same mark, past start-up: who is not in the collective the others wait in
        behind = tuple(r.rank for r in records if not r.waits)
    quiet = now - max(progressed_at[r.rank] for r in records)
    return Verdict(behind, "behind", quiet) if quiet > after_s and len(behind) < len(records) else None


def process_state(pid: int) -> str | None:
    """``"gone"``, ``"stopped"``, ``"busy"`` (alive) or ``None`` (unknown), from Linux's ``/proc/<pid>/stat``.

    Example::

        >>> process_state(os.getpid())
        'busy'
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return None
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(text.rpartition(")")[2].split()[0], "busy")


class Liveness:
    """The room: name a stalled rank within ``name_after_s``, end the job after ``end_after_s``.

    The training thread calls :meth:`mark`; a daemon thread publishes this rank's :class:`Record` and rank 0
    :func:`judge` s them all; an ended job exits :data:`STALL_EXIT` on every rank.

    Args:
        store: the job's store (the default process group's).
        name_after_s: seconds without progress before a stall is named.
        end_after_s: seconds before the job is ended (``None``: named only).
        folder: where ``stall.txt`` goes (a callable is asked when it is written); ``None``: none.
        rescue: called by the reporting rank before it ends the job; returns what it saved, or ``None``.
        end_running: end at ``end_after_s`` a stall of ranks whose processes run, too.
        collective_timeout_s: a collective failing sooner was not timed out by a rank behind (``None``: unknown).
        exit: how a rank ends the job (``os._exit``; a test passes its own).
        defers: ``defers(verdict, records)``: another watcher (the launcher's) ends the job for it; the room is silent.

    Example::

        >>> import torch.distributed as dist
        >>> room = Liveness(dist.HashStore(), rank=0, world_size=1, name_after_s=30, end_after_s=300)
        >>> room.mark("training step 1")
        >>> room.marks, room.phase
        (1, 'training step 1')
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        name_after_s: float = 30.0,
        end_after_s: float | None = 300.0,
        interval_s: float | None = None,
        folder: str | os.PathLike | Callable[[], str | os.PathLike | None] | None = None,
        rescue: Callable[[], str | None] | None = None,
        exit: Callable[[int], Any] = os._exit,
        end_running: bool = False,
        collective_timeout_s: float | None = None,
        defers: Callable[[Verdict, Sequence[Record]], bool] | None = None,
    ) -> None:
        self.name_after_s = check_number("name_after_s", name_after_s, 0, exclusive_minimum=True)
        check_number("end_after_s", end_after_s, 0, allow_none=True)
        if end_after_s is not None and end_after_s < name_after_s:
            raise ArgumentValueError("end_after_s", f"None or at least name_after_s ({name_after_s:g})", end_after_s)
        self.end_after_s, self.interval_s = end_after_s, interval_s or min(5.0, name_after_s / 6)
        self.store, self.rank, self.world_size = _own_client(store), rank, world_size
        self.folder, self.rescue, self._exit = folder, rescue, exit
        self.end_running, self.collective_timeout_s, self._defers = end_running, collective_timeout_s, defers
        self.marks, self.phase, self.waits, self.state = 0, "starting", False, RankState.RUNNING
        self.verdict: Verdict | None = None
        self._main, self._host, self._ns = threading.main_thread().ident, socket.gethostname(), _pid_namespace()
        self._halt, self._wake, self._ending = threading.Event(), threading.Event(), threading.Lock()
        self._named = threading.Event()  # set: the room's thread said its verdict's line
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ddp_plugins-liveness-store")
        self._thread: threading.Thread | None = None
        self._observer: Record | None = None  # rank 0's last record, as another rank read it
        self._own: BaseException | None = None  # the error failed() let through
        self._asks: list[Ask] = []  # rank 0: its own training thread's question, for its room thread
        self._answers: dict[int, tuple[Verdict | None, list[Record]]] = {}
        self._asks_read = 0  # rank 0: the questions of other ranks answered so far
        self._seq = self._published_marks = 0
        self._published_at = self._marked_at = 0.0
        self._ended = False

    def mark(self, phase: str, waits: bool = False) -> None:
        """The training thread passed a phase boundary; ``waits``: into a collective every rank enters."""
        self.marks += 1
        self.phase, self.waits, self._marked_at = phase, waits, time.monotonic()
        self._wake.set()

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """The training thread waits in a collective every rank enters (``what``) in the body; elsewhere nothing."""
        if threading.get_ident() != self._main:
            yield
            return
        before = (self.phase, self.waits)
        self.mark(f"{what} in {before[0]}", waits=True)
        try:
            yield
        finally:
            self.mark(*before)

    def start(self) -> Liveness:
        global _room
        _room = self
        self._thread = threading.Thread(target=self._run, name="ddp_plugins-liveness", daemon=True)
        self._thread.start()
        return self

    def stop(self, error: BaseException | None = None) -> None:
        """This rank leaves: its fit ended, or it raised ``error`` (said in a last record), then the thread ends."""
        if self._thread is not None and not self._halt.is_set():
            self.state = RankState.LEFT if error is None else RankState.RAISED
            self.phase = "left" if error is None else f"raised {type(error).__name__}: {_first_line(error)}"
            with contextlib.suppress(Exception):
                self._publish()
        global _room
        _room = None if _room is self else _room
        self._halt.set()
        self._wake.set()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.interval_s + 1)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def failed(self, error: BaseException) -> None:
        """If another rank caused ``error``, name it and end the job (no rescue: the step is half done); else return."""
        if error is self._own:  # judged already (the launcher asks before it stops the child ranks)
            return
        verdict, records = self.verdict or self._host_gone(), [self._observer] if self._observer else []
        try:
            if verdict is None:
                verdict, records = self._ask()
        except Exception:  # noqa: BLE001 - the store does not answer: its host, rank 0, is gone
            verdict = Verdict((0,), "gone", 0)
        if verdict is None or self.rank in verdict.ranks:
            self._own = error
            return
        self._halt.set()
        self.rescue = None
        if self._reports(verdict) and self.verdict is None:
            line = verdict.line(_by_rank(records, verdict))
            print(f"error: {line}; a collective failed waiting for it ({type(error).__name__}: {_first_line(error)})",
                  file=sys.stderr, flush=True)  # fmt: skip
        elif self._reports(verdict):  # the room's thread is naming it: its line first
            self._named.wait(_NAMING_S)
        self._end(verdict, records)

    def _ask(self) -> tuple[Verdict | None, list[Record]]:
        """The observer's verdict on this rank's failed collective; no answer in 3 intervals: rank 0 judged here."""
        # timed out: this rank waited in its collective for about the collective timeout (or it is not known)
        timeout = self.collective_timeout_s
        ask = Ask(self.rank, self.waits, timeout is None or time.monotonic() - self._marked_at >= 0.9 * timeout)
        self._publish()  # what this rank waits in, as the observer judges it
        if self.rank == 0:
            if self._thread is None or not self._thread.is_alive():  # no observer thread: judge here
                return self._decide([ask])[0]
            self._asks.append(ask)
            self._wake.set()
        elif not hasattr(self.store, "append"):  # a store of the user's without append: judged here
            return self._decide([ask])[0]
        else:
            self._store(self.store.append, _ASKS, json.dumps(ask._asdict()) + "\n")
        deadline, key = time.monotonic() + 3 * self.interval_s + 2, f"{_ANSWER}{self.rank}"
        while time.monotonic() < deadline:
            if self.rank == 0 and 0 in self._answers:
                return self._answers.pop(0)
            if self.rank != 0 and self._store(self.store.check, [key]):
                told = json.loads(self._store(self.store.get, key))
                if told is None:
                    return None, []
                return Verdict(tuple(told["ranks"]), told["how"], 0), [Record(**r) for r in told["records"]]
            time.sleep(min(0.2, self.interval_s / 4))
        if self._observer is None:
            return None, []
        observer = Record(**json.loads(self._store(self.store.get, f"{_KEY}0")))
        state = self._states([observer])[0]
        if observer.state == RankState.RAISED or state in ("gone", "stopped"):
            return Verdict((0,), "raised" if observer.state == RankState.RAISED else str(state), 0), [observer]
        return None, []

    def _answer_asks(self) -> None:
        """Rank 0's room thread: judge every failed collective asked about since the last round, answer each."""
        asks = list(self._asks)
        del self._asks[: len(asks)]
        stored = self._stored_asks()
        self._asks_read += len(stored)
        asks += stored
        if not asks:
            return
        for ask, (verdict, records) in zip(asks, self._decide(asks), strict=True):
            if ask.rank == 0:
                self._answers[0] = (verdict, records)
                continue
            named = [r._asdict() for r in records if verdict is not None and r.rank in verdict.ranks]
            told = None if verdict is None else {"ranks": list(verdict.ranks), "how": verdict.how, "records": named}
            self._store(self.store.set, f"{_ANSWER}{ask.rank}", json.dumps(told))

    def _decide(self, asks: list[Ask]) -> list[tuple[Verdict | None, list[Record]]]:
        """The verdict for each rank whose collective failed (raised, gone, stopped; silent or behind if it waited)."""
        records = self._records_now()
        if not records:
            return [(None, [])] * len(asks)
        states = self._states(records)
        raised = tuple(r.rank for r in records if r.state == RankState.RAISED)
        stopped = tuple(r.rank for r, state in zip(records, states, strict=True) if state in ("gone", "stopped"))
        found = Verdict(raised, "raised", 0) if raised else None
        if found is None and stopped:
            how = {states[r] for r in stopped}
            found = Verdict(stopped, str(how.pop()) if len(how) == 1 else "stopped", 0)
        if found is None and any(ask.waits for ask in asks):
            found, records = self._afresh(records, asks)
        results: list[tuple[Verdict | None, list[Record]]] = []
        for ask in asks:
            verdict = found
            if verdict is not None and (ask.rank in verdict.ranks or not ask.waits and verdict.how in _LIVE):
                verdict = None  # this rank's own error, or a peer only slow while this rank did not wait
            if verdict is not None and verdict.how == "behind" and not ask.timed_out:
                verdict = None  # the others publish and the wait was short: this rank's own error
            results.append((verdict, records))
        return results

    def _afresh(self, before: list[Record], asks: list[Ask]) -> tuple[Verdict | None, list[Record]]:
        """Judge the records published within 1.5 intervals after the failure: silent, else behind."""
        asking = {ask.rank for ask in asks}
        after, deadline = before, time.monotonic() + 1.5 * self.interval_s
        while time.monotonic() < deadline:
            time.sleep(min(0.2, self.interval_s / 4))
            after = self._records_now()
            if all(a.seq != b.seq for a, b in zip(after, before, strict=True) if a.rank not in asking):
                break
        asking |= self._late_askers()  # asked since this round began: alive and waiting, though it published no more
        now = time.monotonic()
        fresh = zip(after, before, strict=True)
        seen = [now if a.seq != b.seq or a.rank in asking or a.rank == self.rank else _NEVER for a, b in fresh]
        verdict = judge(after, seen, [_NEVER] * len(after), now, 0, self._states(after))
        return (verdict._replace(seconds=0) if verdict else None), after

    def _late_askers(self) -> set[int]:
        """The ranks whose question about a failed collective came after this round's (rank 0's, the store's)."""
        return {ask.rank for ask in [*self._asks, *self._stored_asks()]}

    def _stored_asks(self) -> list[Ask]:
        """The other ranks' questions in the store not yet read into a round (after ``_asks_read``)."""
        if not self._store(self.store.check, [_ASKS]):
            return []
        lines = self._store(self.store.get, _ASKS).decode().splitlines()
        return [Ask(**json.loads(line)) for line in lines[self._asks_read :]]

    def _store(self, call: Callable[..., Any], *args: Any) -> Any:
        """One store call, given up after ``name_after_s`` (``TimeoutError``: the store does not answer)."""
        return self._pool.submit(call, *args).result(timeout=self.name_after_s)

    def _states(self, records: Sequence[Record]) -> list[str | None]:
        return [process_state(r.pid) if self._local(r) else None for r in records]

    def _local(self, record: Record) -> bool:
        """``record``'s PID is one of this host's ``/proc`` (same host, same PID namespace)."""
        return record.host == self._host and record.pid_ns == self._ns

    def _run(self) -> None:
        seen_at, progressed_at = [time.monotonic()] * self.world_size, [time.monotonic()] * self.world_size
        last: dict[int, tuple[int, int]] = {}
        records: list[Record] = []
        since = judged = 0.0  # when the stall named began; when the records were last judged
        failing: float | None = None  # since when every store call failed (not timed out)
        asked = 0.0  # rank 0: when the failed collectives' questions were last read
        while not self._halt.is_set():
            now, throttle = time.monotonic(), self.interval_s / 5
            if self.rank == 0 and (self._asks or now - asked >= throttle):  # a question waits one throttle at most
                asked = now
                with contextlib.suppress(Exception):  # a failing store: the judgement sees it
                    self._answer_asks()
            if now - judged < self.interval_s:  # between two judgements: publish new marks, once per throttle
                if self.marks != self._published_marks and now - self._published_at >= throttle:
                    with contextlib.suppress(Exception):  # the judgement sees a store that fails
                        self._publish()
                self._wake.clear()
                wait = judged + self.interval_s - time.monotonic()
                soon = self.marks != self._published_marks or self.rank == 0  # rank 0 reads the questions too
                self._wake.wait(max(0.0, min(wait, throttle) if soon else wait))
                continue
            judged, ended = now, False
            try:
                verdict = self._host_gone()  # no store call would answer: none is made
                if verdict is None:
                    self._publish()
                    if self.rank == 0:
                        records, verdict, ended = self._observe(seen_at, progressed_at, last)
                    else:
                        records, verdict, ended = self._follow(records, seen_at)
                        if self._observer is None:  # rank 0 has not published yet (its room starts now too)
                            judged = now - self.interval_s + min(throttle, 0.05)
            except TimeoutError:
                verdict = Verdict((0,), "store", self.name_after_s)
            except Exception as error:  # noqa: BLE001 - retried: one failed call does not end the room
                failing = now if failing is None else failing
                if self._halt.is_set() or (self._observer is not None and _left(self._observer)):
                    return  # the store went away with the job: nothing left to watch
                if now - failing >= self.name_after_s:
                    print(f"ddp_plugins: rank {self.rank}'s liveness room stops: its store calls fail for"
                          f" {now - failing:.0f} s ({type(error).__name__}: {_first_line(error)})",
                          file=sys.stderr, flush=True)  # fmt: skip
                    return
                continue
            failing = None
            if ended:
                with contextlib.suppress(Exception):  # rank 0 leaves the store last: no call fails here
                    self._store(self.store.add, _LEFT, 1)
                if self.rank == 0:  # named, the store's host: the reporting rank still counts the others out
                    time.sleep(3 * self.interval_s + 2)
                self._exit(STALL_EXIT)
                return
            if verdict is not None and self._defers is not None and self._defers(verdict, records):
                continue  # another watcher speaks for it (and ends the job)
            if verdict is None:
                if self.verdict is not None and self._reports(self.verdict):
                    print(f"ddp_plugins: ranks {list(self.verdict.ranks)} progress again", file=sys.stderr, flush=True)
                self.verdict = None
                self._named.clear()
                continue
            if self.verdict is None or verdict.ranks != self.verdict.ranks:
                self._named.clear()
                since, self.verdict = time.monotonic() - verdict.seconds, verdict
                if self._reports(verdict):
                    self._name(verdict, records)
            # a gone rank cannot come back: the job ends at once
            due = verdict.how == "gone" or self._ends(verdict) and time.monotonic() - since >= (self.end_after_s or 0)
            if due and (self._reports(verdict) or verdict.how == "store") and not self._halt.is_set():
                self._end(verdict, records)
                return

    def _ends(self, verdict: Verdict) -> bool:
        """Whether ``verdict`` ends the job at the end limit."""
        return self.end_after_s is not None and (self.end_running or verdict.how in _PROVEN)

    def _host_gone(self) -> Verdict | None:
        """Rank 0, the store's host, is gone, as a rank on its host sees in ``/proc``."""
        observer = self._observer
        gone = observer is not None and self._local(observer) and process_state(observer.pid) == "gone"
        return Verdict((0,), "gone", 0) if gone else None

    def _publish(self) -> None:
        """This rank's record, made in the room's one store thread (so an older record is never last)."""
        self._store(self._write_record)

    def _write_record(self) -> None:
        self._seq += 1
        self._published_at, self._published_marks = time.monotonic(), self.marks
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        stack = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else ""
        path = frame.f_code.co_filename.replace(os.sep, "/") if frame is not None else ""
        # the innermost frame is torch.distributed's (a collective, a barrier, a store wait): the thread waits
        waits = self.waits or "/torch/distributed/" in path
        record = Record(
            rank=self.rank, seq=self._seq, marks=self.marks, phase=self.phase, pid=os.getpid(), host=self._host,
            stack=stack, pid_ns=self._ns, waits=waits, state=self.state.value,
        )  # fmt: skip
        self.store.set(f"{_KEY}{self.rank}", json.dumps(record._asdict()))

    def _records_now(self) -> list[Record]:
        """Every rank's record (empty until every rank published)."""
        keys = [f"{_KEY}{rank}" for rank in range(self.world_size)]
        if not self._store(self.store.check, keys):
            return []
        return [Record(**json.loads(value)) for value in self._store(self.store.multi_get, keys)]

    def _observe(
        self, seen_at: list[float], progressed_at: list[float], last: dict
    ) -> tuple[list[Record], Verdict | None, bool]:
        """Rank 0: the records and verdict (told the others when it changes); whether the reporter ended the job."""
        if self.verdict is not None and 0 in self.verdict.ranks:  # another rank reports: has it ended the job?
            told = json.loads(self._store(self.store.get, _VERDICT))
            if told is not None and told["end"]:
                return [], None, True
        records, now = self._records_now(), time.monotonic()
        for record in records:
            seq, marks = last.get(record.rank, (-1, -1))
            seen_at[record.rank] = now if record.seq != seq else seen_at[record.rank]
            progressed_at[record.rank] = now if record.marks != marks else progressed_at[record.rank]
            last[record.rank] = (record.seq, record.marks)
        verdict = judge(records, seen_at, progressed_at, now, self.name_after_s, self._states(records))
        if verdict is None and self.verdict is not None:  # never deleted: a reader's check-then-get never blocks
            self._store(self.store.set, _VERDICT, "null")
        elif verdict is not None and (self.verdict is None or verdict.ranks != self.verdict.ranks):
            self._tell(verdict, end=False)
        return records, verdict, False

    def _tell(self, verdict: Verdict, end: bool) -> None:
        text = json.dumps({"ranks": list(verdict.ranks), "how": verdict.how, "end": end})
        self._store(self.store.set, _VERDICT, text)

    def _follow(self, records: list[Record], seen_at: list[float]) -> tuple[list[Record], Verdict | None, bool]:
        """Any other rank: rank 0's record and the verdict key, each read once it exists (``get`` blocks)."""
        now = time.monotonic()
        if not self._store(self.store.check, [f"{_KEY}0"]):  # rank 0's room has not published yet
            return records, None, False
        observer = self._observer = Record(**json.loads(self._store(self.store.get, f"{_KEY}0")))
        seen_at[0] = now if not records or observer.seq != records[0].seq else seen_at[0]
        told = json.loads(self._store(self.store.get, _VERDICT)) if self._store(self.store.check, [_VERDICT]) else None
        if told is not None and told["end"]:
            return [observer], None, True
        if now - seen_at[0] > self.name_after_s and not _left(observer):  # rank 0 itself is silent
            state = self._states([observer])[0]
            return [observer], Verdict((0,), state or "silent", now - seen_at[0]), False
        verdict = Verdict(tuple(told["ranks"]), told["how"], self.name_after_s) if told is not None else None
        return [observer], verdict, False

    def _reports(self, verdict: Verdict) -> bool:
        """The lowest rank a verdict does not name names it and ends the job."""
        return self.rank == min(set(range(self.world_size)) - set(verdict.ranks))

    def _name(self, verdict: Verdict, records: list[Record]) -> None:
        folder = self.folder() if callable(self.folder) else self.folder
        if folder is not None and self.rank != 0 and _store_answers(verdict):  # rank 0 named: read every record
            with contextlib.suppress(Exception):  # once, for stall.txt (a store that fails: what was read)
                records = self._records_now() or records
        dump = _dump(verdict, records, folder) if folder is not None and records else None
        if verdict.how == "gone":
            ends = "the job ends now"
        elif self._ends(verdict):
            ends = f"the job ends in {round(max(0.0, (self.end_after_s or 0) - verdict.seconds), 1):g} s"
        else:
            ends = "the job goes on (a rank whose process runs is not ended)"
        where = f"; every rank's last record and stack: {dump}" if dump else ""
        named = _by_rank(records, verdict)
        # the stalled rank's record is as old as its last publication: say where this rank is
        phases = {named[r].phase for r in verdict.ranks}
        here = "" if phases == {self.phase} else f" (rank {self.rank} is in {self.phase})"
        print(f"error: {verdict.line(named)}{here}; {ends}{where}", file=sys.stderr, flush=True)
        self._named.set()

    def _end(self, verdict: Verdict, records: list[Record]) -> None:
        """Once per rank (the room's thread and the training thread may both come here), then exit."""
        with self._ending:  # a second caller waits here until the first has ended the process
            if not self._ended:
                self._ended = True
                self._end_once(verdict, records)
        self._exit(STALL_EXIT)

    def _end_once(self, verdict: Verdict, records: list[Record]) -> None:
        """The reporter rescues, tells the others, waits until they left the store, kills the stalled ranks here."""
        store_answers = _store_answers(verdict)
        if not self._reports(verdict):
            with contextlib.suppress(Exception):
                if store_answers:
                    self._store(self.store.add, _LEFT, 1)
            return
        # no mark for an interval: it waits for the stalled rank at a step's state (no mark yet: nothing to save)
        idle = self.marks > 0 and time.monotonic() - self._marked_at > self.interval_s
        try:
            saved = self.rescue() if self.rescue is not None and idle else None
        except Exception as error:  # noqa: BLE001 - the job ends all the same; say why nothing was saved
            saved = f"none written ({type(error).__name__}: {error})"
        resume = f"checkpoint of the last completed step: {saved}" if saved else "it resumes from its newest"
        print(f"error: ending every rank; {resume}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            if store_answers:
                self._tell(verdict, end=True)
                # wait until every running room left the store (its calls would dump C++ stacks); one only behind too
                others = self.world_size - 1 - (len(verdict.ranks) if verdict.how != "behind" else 0)
                deadline = time.monotonic() + 3 * self.interval_s + 2
                while self._store(self.store.add, _LEFT, 0) < others and time.monotonic() < deadline:
                    time.sleep(0.05)
        for record in records:
            if record.rank in verdict.ranks and self._local(record) and record.pid not in (0, os.getpid()):
                with contextlib.suppress(OSError):
                    os.kill(record.pid, signal.SIGKILL)


def _store_answers(verdict: Verdict) -> bool:
    """Whether the job's store still answers once ``verdict`` is named (not if it did not, or rank 0 is gone)."""
    return verdict.how != "store" and not (0 in verdict.ranks and verdict.how == "gone")


def _own_client(store: Any) -> Any:
    """The room's own client (``Store.clone``, else ``store``): a rendezvous's blocking ``get`` never waits on it."""
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        return store


@contextlib.contextmanager
def waiting(what: str) -> Iterator[None]:
    """Mark in this process's room (if any) a wait in a collective the stack does not show (``work.wait()``).

    Example::

        >>> with waiting("the stop flag's all-reduce"):
        ...     pass  # work.wait() here
    """
    room = _room
    with room.waiting(what) if room is not None else contextlib.nullcontext():
        yield


def _pid_namespace() -> str:
    """This process's PID namespace (``/proc/self/ns/pid``), ``""`` where it cannot be read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _left(record: Record) -> bool:
    """The rank left (its fit ended, or it raised): judged no more."""
    return record.state != RankState.RUNNING


def _where(record: Record) -> str:
    if not record.pid:  # nothing read of it: the store's host before its room published, say
        return "no record read yet"
    return f"PID {record.pid} on {record.host}, {record.phase}"


def _first_line(error: BaseException, limit: int = 240) -> str:
    """The error's first non-blank line, cut at a word boundary past ``limit`` characters.

    Example::

        >>> _first_line(RuntimeError("\\n  Read error: Connection reset by peer\\nmore"))
        'Read error: Connection reset by peer'
        >>> _first_line(RuntimeError("word " * 100), limit=12)
        'word word...'
    """
    line = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + "..."


def _by_rank(records: Sequence[Record], verdict: Verdict) -> list[Record]:
    by_rank = {r.rank: r for r in records}
    return [by_rank.get(r, Record(r, 0, 0, "unknown", 0, "?")) for r in range(max(verdict.ranks) + 1)]


def _dump(verdict: Verdict, records: list[Record], folder: str | os.PathLike) -> str | None:
    """Every rank's last record, stack included, to ``folder/stall.txt``."""
    lines = [f"ranks {list(verdict.ranks)}: {_HOW[verdict.how]} ({verdict.seconds:.0f} s)"]
    for r in records:
        lines += [f"\nrank {r.rank} (PID {r.pid} on {r.host}), marks {r.marks}, last: {r.phase}", r.stack]
    try:
        write_text_atomic(Path(folder) / "stall.txt", "\n".join(lines))
    except OSError:
        return None
    return str(Path(folder) / "stall.txt")
