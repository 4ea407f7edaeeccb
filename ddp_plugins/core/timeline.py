"""Where DDP time goes: per-rank step phases and reported collectives on one clock, blame, one Chrome trace.

See docs/design.md, "Where time goes"."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ddp_plugins.core.checks import ArgumentTypeError, check_int, check_number
from ddp_plugins.core.files import write_text_atomic
from ddp_plugins.core.ranks import collective_device, is_distributed

__all__ = ["PHASES", "CollectiveRecord", "TimedCommHook", "Timeline", "collective_kind"]

#: The phases of a training step a :class:`Timeline` times, in order.
PHASES = ("data_wait", "forward", "backward", "optimizer", "step")

_active: Timeline | None = None  # where collective_kind reports (Timeline.activate)


class _Local(threading.local):
    depth = 0  # > 0 inside a collective_kind body: nested ones are part of it


_local = _Local()


class CollectiveRow(NamedTuple):
    """One rank's collective as :meth:`Timeline.collect` gathers it (times: ns since the trace's origin)."""

    rank: int
    step: int
    seq: int
    start: int
    end: int
    nbytes: int
    kind: str
    op: str


class PhaseRow(NamedTuple):
    """One rank's step phase as :meth:`Timeline.collect` gathers it (times: ns since the trace's origin)."""

    rank: int
    step: int
    phase: str
    start: int
    end: int


class _ScorePoint(NamedTuple):
    """A rank's straggler score (ms, a moving mean of its excess lead) at the end of a step (ns)."""

    rank: int
    end: float
    score: float


class _Window(NamedTuple):
    """One :meth:`Timeline.collect`'s gathered rows, kept on rank 0 for the trace."""

    coll: list[CollectiveRow]
    phase: list[PhaseRow]
    last: dict[int, CollectiveRow]  # seq: its last arrival
    score_points: list[_ScorePoint]
    blamed: dict[int, int]  # step: rank


class CollectiveRecord:
    """One collective call on this rank: times in ns on rank 0's clock (``end_ns`` 0 while in flight)."""

    __slots__ = ("end_ns", "events", "kind", "nbytes", "op", "seq", "start_ns", "step")

    def __init__(self, seq: int, step: int, kind: str, op: str, nbytes: int, start_ns: int) -> None:
        self.seq, self.step, self.kind, self.op, self.nbytes = seq, step, kind, op, nbytes
        self.start_ns, self.end_ns = start_ns, 0
        self.events: list[Any] | None = None  # CUDA tensors: [start, end] events on the calling stream

    def __repr__(self) -> str:
        took = f"{(self.end_ns - self.start_ns) / 1e6:.2f} ms" if self.end_ns else "in flight"
        return f"#{self.seq} {self.op} ({self.kind}, {self.nbytes} B, step {self.step}): {took}"


class _GpuClock:
    """CUDA events on the timeline's clock via an anchor event of known host time (CUDA collectives return early)."""

    anchor: Any = None
    anchor_ns = 0

    def reanchor(self, now_ns: Callable[[], int]) -> None:
        torch.cuda.synchronize()
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record()
        self.anchor.synchronize()
        self.anchor_ns = now_ns()

    def event(self, now_ns: Callable[[], int]) -> Any:
        if self.anchor is None:
            self.reanchor(now_ns)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def to_ns(self, event: Any) -> int:
        event.synchronize()
        return self.anchor_ns + int(self.anchor.elapsed_time(event) * 1e6)


@contextlib.contextmanager
def collective_kind(kind: str, op: str = "collective", cuda: bool = False) -> Iterator[None]:
    """Record the body as one collective of ``kind`` in the active :class:`Timeline` (none active: nothing).

    A label inside another is part of it; ``cuda``: time it by events on the current CUDA stream, not the host.

    Example::

        >>> timeline = Timeline().activate()
        >>> with collective_kind("my_metric", "all_reduce"):
        ...     pass  # dist.all_reduce(...) here
        >>> timeline.deactivate()
        >>> timeline.recent[-1].kind, timeline.recent[-1].op
        ('my_metric', 'all_reduce')
    """
    if not isinstance(kind, str) or not kind:
        raise ArgumentTypeError("kind", "a non-empty str", kind)
    timeline = _active if not _local.depth else None
    record = timeline._start(kind, op, 0, cuda) if timeline is not None else None
    _local.depth += 1
    try:
        yield
    finally:
        _local.depth -= 1
        if timeline is not None and record is not None:
            timeline._end(record)


class TimedCommHook:
    """A DDP communication hook that records each bucket's reduction (to its future's end) in a :class:`Timeline`.

    Args:
        hook: the hook to wrap, ``hook(state, bucket) -> Future``; ``None`` is DDP's default all-reduce.

    Example::

        >>> hook = TimedCommHook(Timeline())
        >>> hook.__qualname__
        'TimedCommHook(allreduce_hook)'
        >>> # ddp_model.register_comm_hook(state=None, hook=hook)
    """

    def __init__(self, timeline: Timeline, hook: Callable[..., Any] | None = None) -> None:
        if not isinstance(timeline, Timeline):
            raise ArgumentTypeError("timeline", "a Timeline", timeline)
        if hook is not None and not callable(hook):
            raise ArgumentTypeError("hook", "a DDP communication hook (callable) or None", hook)
        self.timeline = timeline
        self.hook = hook if hook is not None else allreduce_hook
        self.__name__ = "timed_comm_hook"  # DDP and Lightning read these names
        self.__qualname__ = f"TimedCommHook({getattr(self.hook, '__qualname__', type(self.hook).__name__)})"

    def __call__(self, state, bucket):
        # no annotations: DDP compares them with the real classes
        buffer = bucket.buffer()
        record = self.timeline._start("ddp_bucket", "all_reduce", buffer.nbytes, cuda=buffer.is_cuda)

        def done(fut):  # DDP waits on this future; on CUDA `then` runs on streams that wait for the collective
            self.timeline._end(record)
            return fut.value()

        return self.hook(state, bucket).then(done)


class Timeline:
    """Per-rank step phases and collectives, their blame, and one Chrome trace for all ranks.

    Written by hand: torch's profiler puts no two ranks on one clock nor says whom they waited for.
    Only reported collectives are recorded (:meth:`comm_hook`, :meth:`time_buffer_broadcast`, an active
    :func:`collective_kind`); blame rule: docs/design.md, "Where time goes".

    Args:
        history: collectives kept in ``recent`` (the last ones).
        blame_threshold_s: the least excess in a step that blames the step on a rank.
        score_decay: weight of the newest step in the moving straggler score (0 < decay <= 1).
        max_trace_events: records kept for the trace, about (the oldest windows are dropped first).
        group: the process group whose ranks are compared (``None``: the default group).

    Example::

        >>> timeline = Timeline()
        >>> for step in range(2):
        ...     timeline.begin_step(step)  # the time since the last step ended: data wait
        ...     with timeline.phase("forward"):
        ...         pass
        ...     timeline.end_step()
        >>> report = timeline.collect()  # no process group: this rank alone
        >>> report["steps"], sorted(report["phases_ms"])
        (2, ['data_wait', 'forward', 'step'])
    """

    def __init__(
        self,
        history: int = 64,
        blame_threshold_s: float = 0.005,
        score_decay: float = 0.1,
        max_trace_events: int = 200_000,
        group: Any = None,
    ) -> None:
        self.recent: deque[CollectiveRecord] = deque(maxlen=check_int("history", history, 1))
        self.blame_threshold_ns = int(check_number("blame_threshold_s", blame_threshold_s, 0.0) * 1e9)
        self.score_decay = check_number("score_decay", score_decay, 0.0, 1.0, exclusive_minimum=True)
        self.max_trace_events = check_int("max_trace_events", max_trace_events, 0)
        self.group = group
        self.offset_ns = 0  # this rank's clock minus rank 0's
        self.clock_residual_ns = 0
        self.origin_ns = time.perf_counter_ns()  # time 0 of the trace, on rank 0's clock after sync_clocks
        self.seq = 0
        self.step = -1  # the step under way; -1 between steps
        self.scores: dict[int, float] = {}
        self._windows: deque[_Window] = deque()  # rank 0: the gathered records, for the trace
        self._window_rows = 0
        self._pending: list[CollectiveRecord] = []
        self._phases: list[tuple[int, str, int, int]] = []
        self._step_start = self._phase_start = self._last_step_end = 0
        self._steps, self._step_ns = 0, 0.0  # the run so far, over every rank (summary())
        self._kind_ns: defaultdict[str, float] = defaultdict(float)
        self._blame: defaultdict[int, float] = defaultdict(float)  # rank: ms of excess
        self._blamed: dict[int, int] = defaultdict(int)
        self._left_ns: dict[int, float] = {}  # rank: when it left its last collective collected
        self._gpu = _GpuClock()

    def now(self) -> int:
        """Now, in ns on rank 0's clock."""
        return time.perf_counter_ns() - self.offset_ns

    def sync_clocks(self, rounds: int = 8) -> tuple[int, int]:
        """Estimate this rank's clock offset to rank 0 (a collective); returns ``(offset_ns, residual_ns)``:
        the median over ``rounds`` barrier-aligned exchanges, and half their spread (largest over ranks)."""
        check_int("rounds", rounds, 1)
        if not is_distributed():
            return 0, 0
        device = collective_device(self.group)
        estimates = []
        for _ in range(rounds):
            dist.barrier(group=self.group)
            stamp = torch.tensor([time.perf_counter_ns()], dtype=torch.int64, device=device)
            stamps = [torch.zeros_like(stamp) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(stamps, stamp, group=self.group)
            estimates.append(int(stamp) - int(stamps[0]))
        offset = int(statistics.median(estimates))
        spread = torch.tensor([(max(estimates) - min(estimates)) // 2], dtype=torch.int64, device=device)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=self.group)
        origin = torch.tensor([time.perf_counter_ns() - offset], dtype=torch.int64, device=device)
        dist.broadcast(origin, group=self.group, group_src=0)
        self.offset_ns, self.clock_residual_ns, self.origin_ns = offset, int(spread), int(origin)
        return self.offset_ns, self.clock_residual_ns

    def activate(self) -> Timeline:
        """Record the :func:`collective_kind` bodies of this process from now on (one timeline at a time)."""
        global _active
        _active = self
        return self

    def deactivate(self) -> None:
        """Stop recording :func:`collective_kind` bodies (when this timeline is the active one)."""
        global _active
        if _active is self:
            _active = None

    def comm_hook(self, hook: Callable[..., Any] | None = None) -> TimedCommHook:
        """A :class:`TimedCommHook` recording here, wrapping ``hook`` (``None``: DDP's all-reduce)."""
        return TimedCommHook(self, hook)

    def time_buffer_broadcast(self, model: DistributedDataParallel) -> list[Any]:
        """Record DDP's buffer broadcast before each forward (kind ``ddp_buffers``) through forward
        pre-hooks on ``model`` and its module; returns their handles (``handle.remove()`` stops it)."""
        if not isinstance(model, DistributedDataParallel):
            raise ArgumentTypeError("model", "a DistributedDataParallel model", model)
        buffers = list(model.module.buffers())
        nbytes, cuda = sum(b.nbytes for b in buffers), any(b.is_cuda for b in buffers)
        pending: list[CollectiveRecord] = []

        def start(module, args):
            if model.will_sync_module_buffers():
                pending.append(self._start("ddp_buffers", "broadcast", nbytes, cuda))

        def end(module, args):
            if pending:
                self._end(pending.pop())

        return [model.register_forward_pre_hook(start), model.module.register_forward_pre_hook(end, prepend=True)]

    def begin_step(self, step: int) -> None:
        """A training step starts: the time since the previous one ended is its data wait."""
        now = self.now()
        self.step = step
        if self._last_step_end:
            self._phases.append((step, "data_wait", self._last_step_end, now))
        self._step_start = self._phase_start = now

    def mark(self, phase: str) -> None:
        """End ``phase`` now; it began where the previous phase of this step ended."""
        if self.step < 0:
            return
        now = self.now()
        self._phases.append((self.step, phase, self._phase_start, now))
        self._phase_start = now

    def skip(self) -> None:
        """Start the next phase now (what ran since the previous mark belongs to no phase)."""
        self._phase_start = self.now()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name`` of the current step."""
        self.skip()
        try:
            yield
        finally:
            self.mark(name)

    def end_step(self) -> None:
        if self.step < 0:
            return
        now = self.now()
        self._phases.append((self.step, "step", self._step_start, now))
        self._last_step_end = now
        self.step = -1

    def _start(self, kind: str, op: str, nbytes: int, cuda: bool = False) -> CollectiveRecord:
        self.seq += 1
        record = CollectiveRecord(self.seq, self.step, kind, op, nbytes, self.now())
        if cuda:
            record.events = [self._gpu.event(self.now), None]
        self._pending.append(record)
        self.recent.append(record)
        return record

    def _end(self, record: CollectiveRecord) -> None:
        if record.events is not None:
            record.events[1] = self._gpu.event(self.now)
        record.end_ns = self.now()

    def collect(self) -> dict[str, Any]:
        """Gather every rank's records since the last call (a collective); blame, score, trace.

        Returns this window's ``steps``, per step ``phases_ms`` and ``comm_ms`` (per kind; this rank's),
        ``wait_ms`` (for the last arrival), ``blamed`` (``{step: rank}``), ``scores`` (``{rank: ms}``).
        """
        records = [r for r in self._pending if r.end_ns]
        self._pending = [r for r in self._pending if not r.end_ns]
        timed_on_gpu = [r for r in records if r.events is not None]
        for r in timed_on_gpu:  # the stream's times replace the host's
            r.start_ns, r.end_ns = (self._gpu.to_ns(event) for event in r.events)  # type: ignore[union-attr]
            r.events = None
        if timed_on_gpu:
            self._gpu.reanchor(self.now)  # the next window's events, against a fresh anchor
        phases, self._phases = self._phases, []
        rank, origin = (dist.get_rank(self.group) if is_distributed() else 0), self.origin_ns
        mine = (
            [CollectiveRow(rank, r.step, r.seq, r.start_ns - origin, r.end_ns - origin, r.nbytes, r.kind, r.op)
             for r in records],
            [PhaseRow(rank, s, p, a - origin, b - origin) for s, p, a, b in phases],
        )  # fmt: skip
        gathered: list[Any] = [mine]
        if is_distributed():
            gathered = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, mine, group=self.group)
        coll, phase = [c for rows, _ in gathered for c in rows], [p for _, rows in gathered for p in rows]
        return self._analyse(coll, phase, rank)

    def _analyse(self, coll: list[CollectiveRow], phase: list[PhaseRow], rank: int) -> dict[str, Any]:
        """This window's report for ``rank`` from every rank's rows; the run's totals and scores move on."""
        last, leads = _arrivals(coll, self._gaps(coll))
        per_step, step_end = self._phase_totals(phase, rank)
        comm, waited = self._comm_totals(coll, last, rank)
        steps = sorted({step for _, step in step_end})
        blamed, score_points = self._blame_steps(steps, leads, step_end)
        self._steps += len(steps)
        if rank == 0:  # the trace is built when written: here every rank does the same work
            self._keep(_Window(coll, phase, last, score_points, blamed))
        n = max(len(steps), 1)
        return {
            "steps": len(steps),
            "phases_ms": {name: total / n / 1e6 for name, total in per_step.items()},
            "comm_ms": {kind: total / n / 1e6 for kind, total in comm.items()},
            "wait_ms": waited / n / 1e6,
            "blamed": blamed,
            "scores": dict(self.scores),
        }

    def _gaps(self, coll: list[CollectiveRow]) -> dict[tuple[int, int], float | None]:
        """``{(rank, seq): gap}``: the rank's own work since it left its previous collective (None before its first)."""
        gaps: dict[tuple[int, int], float | None] = {}
        for c in sorted(coll, key=lambda row: (row.rank, row.seq, row.start, row.end)):
            left = self._left_ns.get(c.rank)
            gaps[c.rank, c.seq] = None if left is None else c.start - left
            self._left_ns[c.rank] = c.end if left is None else max(left, c.end)
        return gaps

    def _phase_totals(self, phase: list[PhaseRow], rank: int) -> tuple[dict[str, float], dict[tuple[int, int], float]]:
        """This rank's time per phase, and ``{(rank, step): when it ended}`` for every rank."""
        per_step: dict[str, float] = defaultdict(float)
        step_end: dict[tuple[int, int], float] = {}
        for p in phase:
            if p.rank == rank:
                per_step[p.phase] += p.end - p.start
            if p.phase == "step":
                self._step_ns += p.end - p.start
                step_end[p.rank, p.step] = p.end
        return per_step, step_end

    def _comm_totals(
        self, coll: list[CollectiveRow], last: dict[int, CollectiveRow], rank: int
    ) -> tuple[dict[str, float], float]:
        """This rank's time per collective kind in steps, and its wait there for the last arrivals."""
        comm: dict[str, float] = defaultdict(float)
        waited = 0.0
        for c in coll:
            if c.step >= 0:
                self._kind_ns[c.kind] += c.end - c.start
                if c.rank == rank:
                    comm[c.kind] += c.end - c.start
                    waited += last[c.seq].start - c.start
        return comm, waited

    def _blame_steps(
        self, steps: list[int], leads: dict[int, dict[int, float]], step_end: dict[tuple[int, int], float]
    ) -> tuple[dict[int, int], list[_ScorePoint]]:
        """``{step: rank}`` for the steps a rank's excess blames, and every rank's score after each step."""
        world = dist.get_world_size(self.group) if is_distributed() else 1
        blamed: dict[int, int] = {}
        score_points: list[_ScorePoint] = []
        for step in steps:
            by_rank = leads.get(step, {})
            # excess: the lead over the rank that led most besides it (shared jitter cancels)
            net = {
                r: max(ns - max((o for q, o in by_rank.items() if q != r), default=0.0), 0.0)
                for r, ns in by_rank.items()
            }
            top = max(net, key=lambda r: net[r], default=None)
            if top is not None and net[top] > self.blame_threshold_ns:
                blamed[step] = top
                self._blamed[top] += 1
            for r in range(world):
                excess = net.get(r, 0.0) / 1e6
                self._blame[r] += excess
                self.scores[r] = self.scores.get(r, excess) + self.score_decay * (excess - self.scores.get(r, excess))
                score_points.append(_ScorePoint(r, step_end.get((r, step), 0.0), self.scores[r]))
        return blamed, score_points

    def _keep(self, window: _Window) -> None:
        """Keep ``window`` for the trace, dropping the oldest past ``max_trace_events`` rows."""
        self._windows.append(window)
        self._window_rows += len(window.coll) + len(window.phase)
        while self._window_rows > self.max_trace_events and len(self._windows) > 1:
            dropped = self._windows.popleft()
            self._window_rows -= len(dropped.coll) + len(dropped.phase)

    def summary(self) -> dict[str, Any]:
        """The run so far: the slowest rank, its excess per step, the share of step time per collective kind.

        Returns ``slowest_rank`` (most excess; ``None``: no rank had any), ``excess_ms_per_step``, ``blamed_steps``
        ``{rank: steps}``, ``comm_share`` ``{kind: its time / step time}`` summed over ranks, ``clock_residual_us``.
        """
        blame = {r: ns for r, ns in self._blame.items() if ns > 0}
        slowest = max(blame, key=blame.get) if blame else None  # type: ignore[arg-type]
        return {
            "steps": self._steps,
            "slowest_rank": slowest,
            "excess_ms_per_step": round(blame[slowest] / max(self._steps, 1), 3) if slowest is not None else 0.0,
            "blamed_steps": dict(self._blamed),
            "comm_share": {kind: round(ns / max(self._step_ns, 1), 4) for kind, ns in sorted(self._kind_ns.items())},
            "clock_residual_us": round(self.clock_residual_ns / 1e3, 1),
        }

    def chrome_trace(self) -> dict[str, Any]:
        """The trace of every rank (gathered on rank 0 by :meth:`collect`), Chrome's JSON object format:
        per rank a thread of step phases, one of collectives, and a straggler score counter; in µs."""
        events: list[dict[str, Any]] = []
        for window in self._windows:
            for c in window.coll:
                last = window.last[c.seq]
                args = {
                    "op": c.op, "seq": c.seq, "bytes": c.nbytes, "step": c.step,
                    "waited_for_last_ms": round((last.start - c.start) / 1e6, 3), "last_arrival": last.rank,
                }  # fmt: skip
                events.append(_span(c.kind, "collective", c.rank, 1, c.start, c.end, args))
            for p in window.phase:
                args = {"step": p.step, "blamed": window.blamed.get(p.step)} if p.phase == "step" else {}
                events.append(_span(p.phase, "phase", p.rank, 0, p.start, p.end, {"step": p.step, **args}))
            for point in window.score_points:
                args = {"score": round(point.score, 3)}
                events.append(
                    {"name": "straggler score (ms)", "ph": "C", "pid": point.rank, "ts": point.end / 1e3, "args": args}
                )
        ranks = sorted({int(event["pid"]) for event in events})
        names = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in ranks]
        names += [
            {"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}}
            for r in ranks
            for tid, name in ((0, "step phases"), (1, "collectives"))
        ]
        return {"traceEvents": names + events, "displayTimeUnit": "ms", "otherData": self.summary()}

    def write_chrome_trace(self, path: str | os.PathLike) -> Path:
        """Write :meth:`chrome_trace` to ``path`` (atomically; open it in Perfetto or ``chrome://tracing``)."""
        path = Path(path)
        write_text_atomic(path, json.dumps(self.chrome_trace()))
        return path


def _arrivals(
    coll: list[CollectiveRow], gaps: dict[tuple[int, int], float | None]
) -> tuple[dict[int, CollectiveRow], dict[int, dict[int, float]]]:
    """Each collective's last arrival (``{seq: row}``), and per step each rank's lead in ns (``{step: {rank: ns}}``)."""
    arrivals: dict[int, list[CollectiveRow]] = defaultdict(list)  # seq: every rank's row
    for c in coll:
        arrivals[c.seq].append(c)
    last: dict[int, CollectiveRow] = {}
    leads: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for seq, rows in arrivals.items():
        rows.sort(key=lambda row: (row.start, row.rank, row.step))  # as they arrived
        final = last[seq] = rows[-1]
        lead = final.start - rows[-2].start if len(rows) > 1 else 0.0
        # only by what its own gap exceeds the others' (docs/design.md, "Where time goes")
        own, others = gaps.get((final.rank, seq)), [gaps.get((c.rank, seq)) for c in rows[:-1]]
        known = [gap for gap in others if gap is not None]
        if own is not None and known and len(known) == len(others):
            lead = min(lead, max(own - max(known), 0.0))
        if final.step >= 0:
            leads[final.step][final.rank] += lead
    return last, leads


def _span(name: str, cat: str, pid: int, tid: int, start: float, end: float, args: dict) -> dict[str, Any]:
    """A Chrome trace's complete event (``ph: X``), times in ns to µs."""
    ts, dur = start / 1e3, max(end - start, 0.0) / 1e3
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}
