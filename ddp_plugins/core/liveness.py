"""One liveness room for a job: every rank publishes one progress record, one observer judges them,
a stall is named within ``name_after_s`` and the job ended only after ``end_after_s``.

Rationale in docs/design.md ("When a rank fails or stops")."""

from __future__ import annotations

import concurrent.futures
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

from ddp_plugins.core.checks import ArgumentValueError, check_number
from ddp_plugins.core.files import write_text_atomic

__all__ = [
    "STALL_EXIT",
    "Liveness",
    "Record",
    "RendezvousError",
    "Verdict",
    "judge",
    "process_state",
    "rendezvous_error",
]

STALL_EXIT = 1
_KEY = "ddp_plugins/liveness/"
_VERDICT, _LEFT = f"{_KEY}verdict", f"{_KEY}left"


class Record(NamedTuple):
    """What a rank publishes every interval: how far its training thread got, and where it is."""

    rank: int
    seq: int  # publications so far: stops advancing when the process (or its Python threads) stops
    marks: int  # phase boundaries and collectives passed, in order: stops advancing when the rank is stuck
    phase: str  # where the training thread is, such as "training step 37" or "in reduce (sync_dist)"
    pid: int
    host: str
    stack: str = ""  # the training thread's stack when published, innermost last


class Verdict(NamedTuple):
    """The ranks that stopped, how, and for how long (``how``: see :func:`judge`)."""

    ranks: tuple[int, ...]
    how: str
    seconds: float

    def line(self, records: Sequence[Record]) -> str:
        """One line naming the ranks (``records`` by rank)."""
        who = ", ".join(f"rank {r} (PID {records[r].pid} on {records[r].host}, {records[r].phase})" for r in self.ranks)
        return f"{who}: {_HOW[self.how]}" + (f" for {self.seconds:.0f} s" if self.seconds else "")


_HOW = {
    "gone": "its process is gone (killed or exited)",
    "stopped": "its process is stopped (SIGSTOP or a debugger)",
    "busy": "its process runs but publishes nothing (a C call holding Python's GIL)",
    "silent": "it publishes nothing (stopped, killed or holding the GIL: another host, not told apart)",
    "behind": "it stopped progressing while the other ranks wait for it",
    "store": "the job's store (hosted there) does not answer",
}


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
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return RendezvousError(
        f"the {world_size} ranks did not all meet at {address}:{port} within the timeout ({timeout_s:g} s):"
        f" {first} Check that every node started and can reach that address."
    )


def judge(
    records: Sequence[Record],
    seen_at: Sequence[float],
    progressed_at: Sequence[float],
    now: float,
    after_s: float,
    states: Sequence[str | None] = (),
) -> Verdict | None:
    """The verdict on the ranks' records, from one observer's clock (``None``: nothing to name).

    ``seen_at[r]`` is when rank ``r``'s ``seq`` last changed, ``progressed_at[r]`` when its
    ``marks`` did, ``states[r]`` its process's :func:`process_state` where the observer can see it.
    A gone process is named at once; a rank that published nothing for ``after_s`` is stopped, busy
    or silent; else, when no rank's marks moved for ``after_s`` and some rank passed more, the ranks
    with the fewest are behind. Every rank at the same mark is one long step: no verdict.

    Example::

        >>> rec = lambda rank, marks: Record(rank, 1, marks, f"training step {marks}", 1, "h")
        >>> judge([rec(0, 38), rec(1, 37)], [99, 99], [0, 0], now=100, after_s=30)  # rank 1 stuck in its step
        Verdict(ranks=(1,), how='behind', seconds=100)
        >>> judge([rec(0, 38), rec(1, 38)], [99, 99], [0, 0], now=100, after_s=30) is None  # one long step
        True
        >>> judge([rec(0, 38), rec(1, 37)], [99, 40], [90, 40], now=100, after_s=30, states=[None, "stopped"])
        Verdict(ranks=(1,), how='stopped', seconds=60)
        >>> judge([rec(0, 38), rec(1, 37)], [99, 99], [99, 99], now=100, after_s=30, states=[None, "gone"])
        Verdict(ranks=(1,), how='gone', seconds=1)
    """
    state = list(states) + [None] * (len(records) - len(states))
    gone = [r.rank for r in records if state[r.rank] == "gone"]
    if gone:
        return Verdict(tuple(gone), "gone", max(now - seen_at[r] for r in gone))
    silent = [r.rank for r in records if now - seen_at[r.rank] > after_s]
    if silent:
        kinds = {state[r] or "silent" for r in silent}
        how = kinds.pop() if len(kinds) == 1 else "silent"
        return Verdict(tuple(silent), how, max(now - seen_at[r] for r in silent))
    quiet = now - max(progressed_at)
    fewest = min(r.marks for r in records)
    behind = tuple(r.rank for r in records if r.marks == fewest)
    if quiet <= after_s or len(behind) == len(records):
        return None
    return Verdict(behind, "behind", quiet)


def process_state(pid: int) -> str | None:
    """``"gone"``, ``"stopped"``, ``"busy"`` (running) or ``None`` (not on this host, or unknown),
    from ``/proc/<pid>/stat`` on Linux.

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
    code = text.rpartition(")")[2].split()[0]
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(code, "busy")


class Liveness:
    """The room: name a stalled rank within ``name_after_s``, end the job after ``end_after_s``.

    The training thread calls :meth:`mark` at each phase boundary (a step begins, a backward, a
    collective entered or left). A daemon thread publishes this rank's :class:`Record` every
    ``interval_s`` (one store write); the observer (rank 0) reads every rank's and :func:`judge` s
    them; every other rank reads the verdict key and the observer's record (a frozen observer is
    named by rank 1). A store that does not answer within ``name_after_s`` is itself a verdict on
    its host. On a verdict the reporting rank prints one line and writes every rank's last record
    and stack to ``folder/stall.txt``; at ``end_after_s`` (at once once a collective failed) it
    writes ``rescue()``'s checkpoint, kills the stalled ranks on its host, and every rank exits
    with :data:`STALL_EXIT` without a traceback.

    Args:
        store: the job's store (the default process group's).
        name_after_s: seconds without progress before a stall is named.
        end_after_s: seconds before the job is ended (``None``: named only, never ended).
        folder: where ``stall.txt`` goes (a callable is asked when it is written); ``None``: none.
        rescue: called on the reporting rank before the job ends; returns what it saved, or ``None``.
        exit: how a rank ends the job (``os._exit`` by default; a test passes its own).

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
    ) -> None:
        self.name_after_s = check_number("name_after_s", name_after_s, 0, exclusive_minimum=True)
        check_number("end_after_s", end_after_s, 0, exclusive_minimum=True, allow_none=True)
        if end_after_s is not None and end_after_s < name_after_s:
            raise ArgumentValueError("end_after_s", f"None or at least name_after_s ({name_after_s:g})", end_after_s)
        self.end_after_s = end_after_s
        self.interval_s = interval_s or min(5.0, name_after_s / 6)
        self.store, self.rank, self.world_size = store, rank, world_size
        self.folder, self.rescue, self._exit = folder, rescue, exit
        self.marks, self.phase, self.waits = 0, "starting", False
        self.verdict: Verdict | None = None
        self._main = threading.main_thread().ident
        self._halt, self._ending = threading.Event(), threading.Lock()
        self._ended = False
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ddp_plugins-liveness-store")
        self._thread: threading.Thread | None = None
        self._observer: Record | None = None  # rank 0's last record, as another rank saw it
        self._own: BaseException | None = None  # the error failed() let through
        self._seq = self._published_marks = 0
        self._published_at = 0.0
        self._wake = threading.Event()
        self._host = socket.gethostname()

    def mark(self, phase: str, waits: bool = False) -> None:
        """The training thread passed a phase boundary; ``waits``: into a collective (the backward's
        all-reduce). Published within a fifth of the interval, by the room's thread."""
        self.marks += 1
        self.phase, self.waits = phase, waits
        self._wake.set()

    def start(self) -> Liveness:
        self._thread = threading.Thread(target=self._run, name="ddp_plugins-liveness", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._halt.set()
        self._wake.set()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.interval_s + 1)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def failed(self, error: BaseException) -> None:
        """This rank raised ``error``. When another rank caused it (gone, or, while this rank waited in
        a collective, silent or behind), name that rank in one line and end the job here (exit
        :data:`STALL_EXIT`, no traceback); return when this rank's own code raised."""
        if error is self._own:  # judged already (the launcher asks before it stops the child ranks)
            return
        verdict, records = self.verdict or self._host_gone(), [self._observer] if self._observer else []
        try:
            if verdict is None:
                records = self._records_now()
                verdict = _blame(records, records, self._host, gone_only=True)
            if verdict is None and self.waits:
                verdict, records = self._fresh_blame()
        except Exception:  # noqa: BLE001 - the store does not answer: its host (rank 0) is gone
            verdict = Verdict((0,), "gone", 0)
        if verdict is None or self.rank in verdict.ranks:
            self._own = error  # this rank's own error: it goes through with its traceback
            return
        self._halt.set()
        self.rescue = None  # mid-step (the forward ran): no checkpoint of the last completed step
        if self._reports(verdict) and self.verdict is None:
            first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
            print(
                f"error: {verdict.line(_by_rank(records, verdict))}; a collective failed waiting for it"
                f" ({type(error).__name__}: {first[:200]})",
                file=sys.stderr,
                flush=True,
            )
        self._end(verdict, records)

    def _fresh_blame(self) -> tuple[Verdict | None, list[Record]]:
        """The blame on records every rank published after this one failed (each within an interval);
        a rank that publishes nothing more in 1.5 intervals is silent, a process gone is named at once."""
        self._publish()
        before = after = self._records_now()
        deadline = time.monotonic() + 1.5 * self.interval_s
        while before and time.monotonic() < deadline:
            time.sleep(min(0.2, self.interval_s / 4))
            after = self._records_now()
            if all(a.seq != b.seq for a, b in zip(after, before, strict=True) if a.rank != self.rank):
                break
        return _blame(before, after, self._host, self.rank), after

    # the room's thread

    def _store(self, call: Callable[[], Any]) -> Any:
        """One store call, given up after ``name_after_s``: a store that does not answer is a verdict."""
        return self._pool.submit(call).result(timeout=self.name_after_s)

    def _run(self) -> None:
        seen_at, progressed_at = [time.monotonic()] * self.world_size, [time.monotonic()] * self.world_size
        last: dict[int, tuple[int, int]] = {}
        records: list[Record] = []
        since = judged = 0.0  # when the stall named last began; when the records were last judged
        while not self._halt.is_set():
            now, throttle = time.monotonic(), self.interval_s / 5
            if now - judged < self.interval_s:  # between two judgements: publish marks, at most every throttle
                if self.marks != self._published_marks and now - self._published_at >= throttle:
                    with contextlib.suppress(Exception):  # the next judgement sees a store that fails
                        self._publish()
                self._wake.clear()
                until_judged = judged + self.interval_s - time.monotonic()
                dirty = self.marks != self._published_marks
                self._wake.wait(max(0.0, min(until_judged, throttle) if dirty else until_judged))
                continue
            judged = now
            try:
                verdict, ended = self._host_gone(), False  # no store call would answer: none is made
                if verdict is None:
                    self._publish()
                    if self.rank == 0:
                        records = self._observe(seen_at, progressed_at, last)
                        verdict = self._judge(records, seen_at, progressed_at)
                    else:
                        records, verdict, ended = self._follow(records, seen_at)
            except TimeoutError:
                verdict, ended = Verdict((0,), "store", self.name_after_s), False
            except Exception:  # noqa: BLE001 - the store went away with the job: nothing left to watch
                return
            if ended:
                with contextlib.suppress(Exception):  # rank 0 leaves the store last: no call fails here
                    self._store(lambda: self.store.add(_LEFT, 1))
                self._exit(STALL_EXIT)
                return
            if verdict is None:
                if self.verdict is not None and self._reports(self.verdict):
                    print(f"ddp_plugins: ranks {list(self.verdict.ranks)} progress again", file=sys.stderr, flush=True)
                self.verdict = None
                continue
            if self.verdict is None or verdict.ranks != self.verdict.ranks:
                since = time.monotonic() - verdict.seconds
                self.verdict = verdict
                if self._reports(verdict):
                    self._name(verdict, records)
            due = self.end_after_s is not None and time.monotonic() - since >= self.end_after_s
            if due and (self._reports(verdict) or verdict.how == "store") and not self._halt.is_set():
                self._end(verdict, records)
                return

    def _host_gone(self) -> Verdict | None:
        """Rank 0 (the store's host) is gone, as another rank on its host sees it in ``/proc``."""
        observer = self._observer
        if observer is None or observer.host != self._host or process_state(observer.pid) != "gone":
            return None
        return Verdict((0,), "gone", 0)

    def _publish(self) -> None:
        self._seq += 1
        self._published_at, self._published_marks = time.monotonic(), self.marks
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        stack = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else ""
        record = Record(self.rank, self._seq, self.marks, self.phase, os.getpid(), self._host, stack)
        text = json.dumps(record._asdict())
        self._store(lambda: self.store.set(f"{_KEY}{self.rank}", text))

    def _records_now(self) -> list[Record]:
        keys = [f"{_KEY}{rank}" for rank in range(self.world_size)]
        if not self._store(lambda: self.store.check(keys)):
            return []
        return [Record(**json.loads(value)) for value in self._store(lambda: self.store.multi_get(keys))]

    def _observe(self, seen_at: list[float], progressed_at: list[float], last: dict) -> list[Record]:
        """Rank 0: every rank's record, and when each last published and progressed."""
        records = self._records_now()  # empty until every rank published: judged from the next round
        now = time.monotonic()
        for record in records:
            seq, marks = last.get(record.rank, (-1, -1))
            if record.seq != seq:
                seen_at[record.rank] = now
            if record.marks != marks:
                progressed_at[record.rank] = now
            last[record.rank] = (record.seq, record.marks)
        return records

    def _judge(self, records: list[Record], seen_at: list[float], progressed_at: list[float]) -> Verdict | None:
        """Rank 0: the verdict, published to the other ranks when it changes."""
        if not records:
            return None
        states = [process_state(r.pid) if r.host == self._host else None for r in records]
        verdict = judge(records, seen_at, progressed_at, time.monotonic(), self.name_after_s, states)
        if verdict is None and self.verdict is not None:
            self._store(lambda: self.store.delete_key(_VERDICT))
        elif verdict is not None and (self.verdict is None or verdict.ranks != self.verdict.ranks):
            self._tell(verdict, end=False)
        return verdict

    def _tell(self, verdict: Verdict, end: bool) -> None:
        text = json.dumps({"ranks": list(verdict.ranks), "how": verdict.how, "end": end})
        self._store(lambda: self.store.set(_VERDICT, text))

    def _follow(self, records: list[Record], seen_at: list[float]) -> tuple[list[Record], Verdict | None, bool]:
        """Any other rank: rank 0's record (rank 1 names a silent rank 0) and the verdict key."""
        observer = self._observer = Record(**json.loads(self._store(lambda: self.store.get(f"{_KEY}0"))))
        now = time.monotonic()
        if not records or observer.seq != records[0].seq:
            seen_at[0] = now
        told = None
        if self._store(lambda: self.store.check([_VERDICT])):
            told = json.loads(self._store(lambda: self.store.get(_VERDICT)))
        if told is not None and told["end"]:
            return [observer], None, True
        if now - seen_at[0] > self.name_after_s:  # the observer itself is silent: rank 1 names it
            state = process_state(observer.pid) if observer.host == self._host else None
            return [observer], Verdict((0,), state or "silent", now - seen_at[0]), False
        if told is not None:
            return [observer], Verdict(tuple(told["ranks"]), told["how"], self.name_after_s), False
        return [observer], None, False

    def _reports(self, verdict: Verdict) -> bool:
        """The lowest rank the verdict does not name names it (and ends the job)."""
        return self.rank == min(set(range(self.world_size)) - set(verdict.ranks))

    def _name(self, verdict: Verdict, records: list[Record]) -> None:
        named = _by_rank(records, verdict)
        folder = self.folder() if callable(self.folder) else self.folder
        dump = _dump(verdict, records, folder) if folder is not None and records else None
        ends = f"in {self.end_after_s:g} s" if self.end_after_s else "never"
        where = f"; every rank's last record and stack: {dump}" if dump else ""
        print(f"error: {verdict.line(named)}; the job ends {ends}{where}", file=sys.stderr, flush=True)

    def _end(self, verdict: Verdict, records: list[Record]) -> None:
        """The reporting rank: the rescue checkpoint, the stalled ranks on this host killed, the others told.
        Once per rank: the room's thread and the training thread (whose collective then failed) both come here."""
        with self._ending:  # the second caller waits here until the first has ended the process
            if not self._ended:
                self._ended = True
                self._end_once(verdict, records)
        self._exit(STALL_EXIT)

    def _end_once(self, verdict: Verdict, records: list[Record]) -> None:
        store_answers = verdict.how != "store" and not (0 in verdict.ranks and verdict.how == "gone")
        if not self._reports(verdict):
            if store_answers:
                with contextlib.suppress(Exception):  # the reporter leaves the store last
                    self._store(lambda: self.store.add(_LEFT, 1))
            return
        saved = None
        if self.rescue is not None:
            try:
                saved = self.rescue()
            except Exception as error:  # noqa: BLE001 - the job ends all the same; say why nothing was saved
                saved = f"none written ({type(error).__name__}: {error})"
        resume = f"checkpoint of the last completed step: {saved}" if saved else "it resumes from its newest"
        print(f"error: ending every rank; {resume}", file=sys.stderr, flush=True)
        if store_answers:  # the others leave first: no store call of theirs fails (C++ stack dumps)
            with contextlib.suppress(Exception):
                self._tell(verdict, end=True)
                # every rank whose room still runs acknowledges: a stalled rank that is only behind too
                others = self.world_size - 1 - (len(verdict.ranks) if verdict.how != "behind" else 0)
                deadline = time.monotonic() + 3 * self.interval_s + 2
                while self._store(lambda: self.store.add(_LEFT, 0)) < others and time.monotonic() < deadline:
                    time.sleep(0.05)
        for record in records:
            if record.rank in verdict.ranks and record.host == self._host and record.pid not in (0, os.getpid()):
                with contextlib.suppress(OSError):
                    os.kill(record.pid, signal.SIGKILL)


def _by_rank(records: Sequence[Record], verdict: Verdict) -> list[Record]:
    by_rank = {r.rank: r for r in records}
    return [by_rank.get(r, Record(r, 0, 0, "unknown", 0, "?")) for r in range(max(verdict.ranks) + 1)]


def _blame(
    before: Sequence[Record], after: Sequence[Record], host: str, me: int = -1, gone_only: bool = False
) -> Verdict | None:
    """Who made a collective fail, from two reads of the records: gone ranks (seen from this host),
    then ranks that published nothing between the reads, then the ranks behind the others that did
    not move between the reads (``me``, the rank that asks, is not silent and may be behind).

    Example::

        >>> rec = lambda rank, seq, marks: Record(rank, seq, marks, "training step 3", 1, "h")
        >>> _blame([rec(0, 5, 9), rec(1, 5, 8)], [rec(0, 6, 9), rec(1, 5, 8)], "other host")
        Verdict(ranks=(1,), how='silent', seconds=0)
        >>> _blame([rec(0, 5, 9), rec(1, 5, 8)], [rec(0, 6, 9), rec(1, 6, 8)], "other host")
        Verdict(ranks=(1,), how='behind', seconds=0)
    """
    if not after:
        return None
    states = [process_state(r.pid) if r.host == host else None for r in after]
    gone = tuple(r.rank for r in after if states[r.rank] == "gone")
    if gone or gone_only:
        return Verdict(gone, "gone", 0) if gone else None
    silent = tuple(a.rank for a, b in zip(after, before, strict=True) if a.seq == b.seq and a.rank != me)
    if silent:
        kinds = {states[r] or "silent" for r in silent}
        return Verdict(silent, kinds.pop() if len(kinds) == 1 else "silent", 0)
    fewest = min(r.marks for r in after)
    behind = tuple(r.rank for r in after if r.marks == fewest)
    moved = any(a.marks != b.marks for a, b in zip(after, before, strict=True) if a.rank in behind and a.rank != me)
    return Verdict(behind, "behind", 0) if len(behind) < len(after) and not moved else None


def _dump(verdict: Verdict, records: list[Record], folder: str | os.PathLike) -> str | None:
    """Every rank's last record, stack included, to ``folder/stall.txt``."""
    lines = [f"ranks {list(verdict.ranks)}: {_HOW[verdict.how]} ({verdict.seconds:.0f} s)"]
    for r in records:
        lines += [f"\nrank {r.rank} (PID {r.pid} on {r.host}), marks {r.marks}, last: {r.phase}", r.stack]
    path = Path(folder) / "stall.txt"
    try:
        write_text_atomic(path, "\n".join(lines))
    except OSError:
        return None
    return str(path)
