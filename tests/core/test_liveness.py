"""The liveness room (``core.liveness``): rooms of several ranks in one process on one store, each
rank's room on a thread, with short limits; real processes for what ``/proc`` tells."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from ddp_plugins.core.liveness import STALL_EXIT, Ask, Liveness, RankState, Record, Verdict, judge, process_state

NAME, END, EVERY = 0.4, 1.2, 0.05


class CountingStore:
    """A store that counts its requests (``multi_get`` is one request) and can stop answering."""

    def __init__(self) -> None:
        self.store, self.requests, self.keys_read = dist.HashStore(), 0, 0
        self.answering = threading.Event()
        self.answering.set()
        self._lock = threading.Lock()

    def _request(self, keys: int = 0) -> None:
        self.answering.wait()
        with self._lock:
            self.requests += 1
            self.keys_read += keys

    def set(self, key: str, value: str) -> None:
        self._request()
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        self._request(1)
        return self.store.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._request(len(keys))
        return self.store.multi_get(keys)

    def check(self, keys: list[str]) -> bool:
        self._request()
        return self.store.check(keys)

    def append(self, key: str, value: str) -> None:
        self._request()
        self.store.append(key, value)


def _rooms(store, world_size, exits, tmp_path=None, name=NAME, end=END, end_running=True, timeout=None, every=EVERY):
    """Rooms that end any stall at ``end`` (``end_running``; the default ends only stopped or gone ranks)."""
    options = {"folder": tmp_path, "exit": exits.append, "end_running": end_running, "collective_timeout_s": timeout}
    return [Liveness(store, rank, world_size, name, end, interval_s=every, **options) for rank in range(world_size)]


def _freeze(room):
    """The room's thread stops without a last record, as in a stopped process or one holding the GIL."""
    room._halt.set()
    room._wake.set()


def _wait(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def _ends_in(line, end, name=NAME):
    """The line says the job ends at ``end`` counted from the stall's start (named at least ``name`` in)."""
    said = re.search(r"; the job ends in ([\d.]+) s", line)
    return said is not None and 0 <= float(said.group(1)) <= end - name + 0.05


def _errors(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("world_size", [4, 8])
def test_store_requests_grow_with_the_ranks_not_their_square(world_size):
    """Every rank writes its record and reads rank 0's and the verdict key; only rank 0 reads them all,
    in one request: about 3 requests per rank and interval, plus at most 5 writes of marks passed in
    between (the heartbeat it replaces read every rank's key on every rank: 2 N^2 + N)."""
    store, exits = CountingStore(), []
    rooms = _rooms(store, world_size, exits, name=30, end=None)
    for room in rooms:
        room.mark("a training step (global step 1)")
        room.start()
    time.sleep(0.5)  # the rooms publish at once, then every interval
    stepping = threading.Event()

    def steps():  # every rank passes a mark every millisecond: the most publications there can be
        while not stepping.wait(0.001):
            for room in rooms:
                room.mark("a training step (global step 2)")

    stepper = threading.Thread(target=steps)
    stepper.start()
    store.requests = store.keys_read = 0
    time.sleep(1.0)
    requests, keys = store.requests, store.keys_read
    stepping.set()
    stepper.join()
    for room in rooms:
        room.stop()
    intervals = 1.0 / EVERY
    print(f"N={world_size}: {requests / intervals:.1f} requests, {keys / intervals:.1f} keys per interval")
    # + 5: rank 0 looks for the failed collectives' questions once per fifth of an interval (one check)
    assert requests / intervals <= 8 * world_size + 5, f"{requests / intervals:.1f} store requests per interval"
    assert keys / intervals <= 3 * world_size, f"{keys / intervals:.1f} keys read per interval"
    assert exits == [], "no stall: nobody ends the job"


def test_a_rank_stuck_in_its_step_is_named_once_then_the_job_ends(capsys, tmp_path):
    """Rank 1 is stuck inside its training step (alive, publishing) while rank 0 waits in the backward."""
    store, exits = CountingStore(), []
    rooms = _rooms(store, 2, exits, tmp_path)
    for room in rooms:
        room.mark("a training step (global step 7)")
        room.start()
    rooms[0].mark("a backward (global step 7)")  # rank 0 left the step; rank 1 never does
    assert _wait(lambda: len(exits) == 2, 10 * END), f"the job did not end: {exits}"
    for room in rooms:
        room.stop()
    assert exits == [STALL_EXIT, STALL_EXIT]
    named, ended = _errors(capsys)
    assert named.startswith("error: rank 1 (PID ") and "a training step (global step 7)" in named, named
    assert "it stopped progressing while the other ranks wait for it" in named and _ends_in(named, END), named
    assert ended.startswith("error: ending every rank; it resumes from its newest"), ended
    dump = (tmp_path / "stall.txt").read_text()
    assert "rank 0 (PID" in dump and "rank 1 (PID" in dump and "a backward (global step 7)" in dump, dump
    assert "test_liveness.py" in dump, "each record carries its training thread's stack"


def test_a_pause_shorter_than_the_end_limit_is_named_and_the_run_goes_on(capsys):
    store, exits = CountingStore(), []
    rooms = _rooms(store, 2, exits, name=NAME, end=60)
    for room in rooms:
        room.mark("a validation step (global step 3)")
        room.start()
    rooms[0].mark("a validation step (global step 3)")
    assert _wait(lambda: rooms[0].verdict is not None, 10 * NAME)
    rooms[1].mark("a validation step (global step 3)")  # the slow rank goes on: a compile, a cold cache
    assert _wait(lambda: rooms[0].verdict is None, 10 * NAME), "the verdict outlived the stall"
    time.sleep(3 * EVERY)
    for room in rooms:
        room.stop()
    assert exits == []
    named, again = _errors(capsys)
    assert named.startswith("error: rank 1 (PID ") and _ends_in(named, 60), named
    assert again == "ddp_plugins: ranks [1] progress again", again
    assert store.store.get("ddp_plugins/liveness/verdict") == b"null", "the other ranks are told it is over"


def test_one_long_step_on_every_rank_is_left_alone(capsys):
    store, exits = CountingStore(), []
    rooms = _rooms(store, 3, exits)
    for room in rooms:
        room.mark("a training step (global step 0)")  # a first step that compiles, on every rank
        room.start()
    time.sleep(3 * END)
    for room in rooms:
        room.stop()
    assert exits == [] and all(room.verdict is None for room in rooms)
    assert _errors(capsys) == []


@pytest.mark.parametrize("silent", [1, 0])
def test_a_rank_that_stops_publishing_is_named_by_another(capsys, silent, tmp_path):
    """The room's thread of one rank stops (its process holds the GIL, or is stopped): rank 0 names it,
    or rank 1 names rank 0. In one process /proc shows it running: 'busy'. stall.txt holds every
    rank's record, whichever rank reports (a1c30de: rank 0's only when rank 1 reported)."""
    store, exits = CountingStore(), []
    rooms = _rooms(store, 3, exits, tmp_path)
    for room in rooms:
        room.start()
    time.sleep(3 * EVERY)
    _freeze(rooms[silent])
    assert _wait(lambda: len(exits) >= 1, 10 * END), "nobody ended the job"
    time.sleep(4 * EVERY)
    for room in rooms:
        room.stop()
    lines = _errors(capsys)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"error: rank {silent} (PID ") and "publishes nothing (a C call holding" in lines[0]
    reporter = rooms[1 if silent == 0 else 0]
    assert reporter.verdict == Verdict((silent,), "busy", reporter.verdict.seconds)
    dump = (tmp_path / "stall.txt").read_text()
    assert all(f"rank {r} (PID" in dump for r in range(3)), dump


def test_a_store_that_stops_answering_names_its_host(capsys):
    """Rank 0 hosts the store; frozen, it answers nothing: rank 1 names rank 0, every rank ends."""
    store, exits = CountingStore(), []
    rooms = _rooms(store, 3, exits)
    for room in rooms:
        room.start()
    time.sleep(3 * EVERY)
    store.answering.clear()
    assert _wait(lambda: len(exits) == 3, 10 * (NAME + END)), f"{exits}"
    lines = _errors(capsys)
    assert lines[0].startswith("error: rank 0 (PID ") and "the job's store (hosted there) does not answer" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("error: ending every rank"), lines
    store.answering.set()
    for room in rooms:
        room.stop()


class NoAppendStore(CountingStore):
    """A store of the user's without ``append``: a failing rank judges for itself."""

    def __getattribute__(self, name: str):
        if name == "append":
            raise AttributeError(name)
        return super().__getattribute__(name)


@pytest.mark.parametrize("make_store", [CountingStore, NoAppendStore])
def test_a_failed_collective_names_the_rank_behind_or_lets_its_own_error_through(capsys, make_store):
    store, exits = make_store(), []
    rooms = _rooms(store, 3, exits, name=30, end=None, timeout=EVERY)  # rank 0 waits 3 x EVERY: a timeout
    for room in rooms:
        room.mark("a training step (global step 2)")
        room.start()
    rooms[0].mark("a backward (global step 2)", waits=True)
    rooms[2].mark("a backward (global step 2)", waits=True)
    time.sleep(3 * EVERY)
    rooms[1].failed(RuntimeError("shape mismatch"))  # rank 1's own error: it is the one behind
    assert exits == [] and _errors(capsys) == []
    rooms[0].failed(RuntimeError("Connection reset by peer"))
    assert exits == [STALL_EXIT]
    named, ended = _errors(capsys)
    assert named.startswith("error: rank 1 (PID ") and "a collective failed waiting for it (RuntimeError: Conn" in named
    assert ended.startswith("error: ending every rank"), ended
    for room in rooms:
        room.stop()


def test_process_state_tells_stopped_from_running_and_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_state(child.pid) == "busy"  # running or sleeping: alive
        child.send_signal(signal.SIGSTOP)
        assert _wait(lambda: process_state(child.pid) == "stopped", 5)
        child.kill()
        assert _wait(lambda: process_state(child.pid) == "gone", 5), "a zombie not yet reaped is gone"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) == "gone"


def test_the_limits_are_checked():
    with pytest.raises(ValueError, match="`end_after_s` should be None or at least name_after_s"):
        Liveness(dist.HashStore(), 0, 2, name_after_s=30, end_after_s=10)


def test_a_rank_that_leaves_is_not_named_and_one_that_raised_is_named_by_the_rank_that_waited(capsys):
    store, exits = CountingStore(), []
    rooms = _rooms(store, 3, exits)
    for room in rooms:
        room.mark("a training step (global step 4)")
        room.start()
    time.sleep(3 * EVERY)
    rooms[2].stop()  # its fit ended first: its last record says it left
    time.sleep(3 * END)
    assert exits == [] and _errors(capsys) == [], "a rank that left is not stopped, silent nor gone"
    rooms[1].stop(ValueError("boom in training_step\nmore"))  # its own error: a traceback of its own
    rooms[0].mark("a backward (global step 4)", waits=True)
    rooms[0].failed(RuntimeError("Connection reset by peer"))  # the collective it waited in failed
    assert exits == [STALL_EXIT]
    named, ended = _errors(capsys)
    assert named.startswith("error: rank 1 (PID ") and "raised ValueError: boom in training_step)" in named, named
    assert "it raised an error (its own traceback says where); a collective failed waiting for it" in named, named
    rooms[0].stop()


@pytest.mark.parametrize("where", ["a backward", "an optimizer step"])
def test_a_rank_own_error_soon_after_it_began_waiting_is_not_blamed_on_a_rank_still_computing(capsys, where):
    """Rank 0 raises (CUDA out of memory, an anomaly-mode NaN, a hook's error) right after it entered its
    backward while rank 1 is still in its forward: rank 1 publishes and the collective timeout (60 s)
    has not passed, so the error is rank 0's own (a1c30de named rank 1 and hid rank 0's traceback)."""
    store, exits = CountingStore(), []
    rooms = _rooms(store, 2, exits, name=30, end=None, timeout=60)
    for room in rooms:
        room.mark("a training step (global step 5)")
        room.start()
    time.sleep(3 * EVERY)
    rooms[0].mark(f"{where} (global step 5)", waits=True)
    time.sleep(3 * EVERY)
    rooms[0].failed(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert exits == [] and _errors(capsys) == [], "rank 1, still computing, was blamed for rank 0's own error"
    for room in rooms:
        room.stop()


def test_a_running_rank_is_named_but_not_ended_by_default_and_a_stopped_one_is_ended(capsys, stopped_child):
    """Legitimate work on one rank (a rank-zero-only callback, one rank's slow first step) is named once
    and the job goes on; a rank whose process is stopped is ended at the end limit."""
    store, exits = CountingStore(), []
    rooms = _rooms(store, 2, exits, end_running=False)
    for room in rooms:
        room.mark("a training step (global step 3)")
        room.start()
    rooms[0].mark("a backward (global step 3)", waits=True)  # rank 1 works on, alive (this process)
    time.sleep(3 * END)
    assert exits == [], "a rank whose process runs was ended by the default"
    (named,) = _errors(capsys)
    assert named.startswith("error: rank 1 (PID ") and "the job goes on" in named, named
    rooms[1].mark("a backward (global step 3)", waits=True)
    assert _wait(lambda: rooms[0].verdict is None, 10 * NAME)
    for room in rooms:
        room.stop()
    assert _errors(capsys) == ["ddp_plugins: ranks [1] progress again"]
    store, exits = CountingStore(), []
    rooms = _rooms(store, 2, exits, end_running=False)
    _stopped_rank_1(rooms, store, stopped_child)
    rooms[0].start()
    assert _wait(lambda: exits == [STALL_EXIT], 10 * END), "a stopped rank was not ended"
    named = _errors(capsys)[0]
    assert "its process is stopped" in named and _ends_in(named, END), named
    rooms[0].stop()


@pytest.fixture
def stopped_child():
    """The PID of a process stopped with SIGSTOP."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGSTOP)
        assert _wait(lambda: process_state(child.pid) == "stopped", 5)
        yield child.pid
    finally:
        child.kill()
        child.wait()


def _stopped_rank_1(rooms, store, pid):
    """Rank 1 is the stopped process: its last record, published once."""
    record = Record(1, 1, 1, "a training step (global step 4)", pid, rooms[0]._host, "", rooms[0]._ns)
    rooms[1]._write_record = lambda: store.set("ddp_plugins/liveness/1", json.dumps(record._asdict()))
    rooms[1]._publish()


def test_a_collective_that_fails_while_a_peer_is_stopped_names_it_whatever_the_collective(capsys, stopped_child):
    """A short `strategy.timeout` hits a collective the pack does not mark (DDP's buffer broadcast) while
    rank 1 is stopped: the stopped rank is named in one line and the job ends (a1c30de: a traceback)."""
    store, exits = CountingStore(), []
    rooms = _rooms(store, 2, exits, name=30, end=None)
    _stopped_rank_1(rooms, store, stopped_child)
    rooms[0].start()
    rooms[0].mark("a training step (global step 4)")  # not a marked wait: inside DDP's forward
    rooms[0].failed(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out"))
    assert exits == [STALL_EXIT]
    named, ended = _errors(capsys)
    assert named.startswith("error: rank 1 (PID ") and "its process is stopped" in named, named
    assert "a collective failed waiting for it (RuntimeError: [../third_party/gloo" in named, named
    assert ended.startswith("error: ending every rank"), ended
    rooms[0].stop()


def test_a_store_call_that_fails_once_does_not_end_the_room(capsys):
    """A store error that is not a timeout (a dropped connection) is retried: the room still names a
    stall afterwards (a1c30de's room thread ended at the first one, silently)."""
    store, exits = CountingStore(), []
    failures = [RuntimeError("Connection reset by peer")] * 2
    original = store.multi_get

    def flaky_multi_get(keys):
        if failures:
            raise failures.pop()
        return original(keys)

    store.multi_get = flaky_multi_get
    rooms = _rooms(store, 2, exits)
    for room in rooms:
        room.mark("a training step (global step 1)")
        room.start()
    rooms[0].mark("a backward (global step 1)", waits=True)
    assert _wait(lambda: exits, 10 * END), "the room stopped at a failed store call and never named the stall"
    assert not failures and _errors(capsys)[0].startswith("error: rank 1 (PID ")
    for room in rooms:
        room.stop()


def test_a_rank_in_another_pid_namespace_is_never_judged_from_this_one(capsys):
    """Ranks on one host in separate PID namespaces (containers with host networking): a PID of the
    other namespace says nothing in this /proc, so the rank is not 'gone' (nor killed) at once."""
    store, exits = CountingStore(), []
    # a name limit far above the window: a loaded machine's late publication is not what is tested
    # (CI, 8f8c9df: 0.2 s sleeps against a 0.4 s limit named the rank "silent")
    rooms = _rooms(store, 2, exits, name=5.0, end=None)
    host, missing = rooms[0]._host, 2**22 + 1  # above Linux's largest PID: no such process here
    records = iter(Record(1, seq, 1, "a training step", missing, host, "", "pid:[4026531000]") for seq in range(1, 99))
    rooms[1]._write_record = lambda: store.set("ddp_plugins/liveness/1", json.dumps(next(records)._asdict()))
    rooms[1]._publish()
    rooms[0].start()
    for _ in range(20):  # the other rank publishes on: it is alive, wherever it runs
        time.sleep(EVERY)
        rooms[1]._publish()
    assert exits == [] and _errors(capsys) == [], "a rank of another PID namespace was judged from this /proc"
    assert rooms[0]._states([next(records)]) == [None]
    rooms[0].stop()


def _rank_1_behind(store, world_size, exits):
    """Running rooms whose records are published, every rank but rank 1 waiting in a backward one mark on."""
    rooms = _rooms(store, world_size, exits, name=30, end=None, timeout=EVERY, every=1.0)
    for room in rooms:
        room.mark("a training step (global step 3)")
        room.start()
    for room in rooms[:1] + rooms[2:]:
        room.mark("a backward (global step 3)", waits=True)
    time.sleep(1.5)  # every record published, rank 1's with one mark fewer
    return rooms


@pytest.mark.parametrize("world_size", [4, 8])
def test_the_failure_path_store_traffic_grows_with_the_ranks_not_their_square(world_size, capsys):
    """Every rank but rank 1 waits in a collective that fails at once: each asks the observer (one
    append, then one key polled) and rank 0 alone reads every record, so the keys read grow with N
    (a1c30de: every failing rank read every record, repeatedly: about 6 N^2)."""
    store, exits = CountingStore(), []
    rooms = _rank_1_behind(store, world_size, exits)
    store.requests = store.keys_read = 0
    failing = [
        threading.Thread(target=room.failed, args=(RuntimeError("Timed out"),)) for room in rooms if room.rank != 1
    ]
    for thread in failing:
        thread.start()
    for thread in failing:
        thread.join(timeout=20)
    requests, keys = store.requests, store.keys_read
    for room in rooms:
        room.stop()
    assert set(exits) == {STALL_EXIT} and len(exits) >= world_size - 1, "every failing rank ends the job"
    named = _errors(capsys)[0]
    assert named.startswith("error: rank 1 (PID ") and "it stopped progressing" in named, named
    # measured here: about 17 N keys and 24 N requests over the 2.4 s window, periodic traffic included
    assert keys <= 24 * world_size, f"{keys} keys read on the failure path of {world_size} ranks"
    assert requests <= 48 * world_size, f"{requests} store requests on the failure path of {world_size} ranks"


def test_a_rank_whose_question_comes_while_the_others_are_judged_is_not_the_one_named():
    """A failing rank's question can reach rank 0 after the round that judges the others began, and its room may
    publish nothing more within that round's window (a loaded machine: CI at 2fef61a named rank 2 "busy" in the
    test above). It asked, so it is alive and waiting: the rank behind is named, not it."""
    store, exits = CountingStore(), []
    rooms = _rank_1_behind(store, 4, exits)
    _freeze(rooms[0])  # this test stands for rank 0's room thread, the one judge
    _freeze(rooms[2])  # rank 2's room publishes no more: only its question says it is there
    late = Ask(2, waits=True, timed_out=True)
    asking = threading.Timer(0.3, lambda: store.append("ddp_plugins/liveness/asks", json.dumps(late._asdict()) + "\n"))
    asking.start()
    try:
        verdict, _ = rooms[0]._decide([Ask(0, waits=True, timed_out=True), Ask(3, waits=True, timed_out=True)])[0]
    finally:
        asking.join()
        for room in rooms:
            room.stop()
    assert verdict is not None and verdict.ranks == (1,), verdict


def test_a_gone_rank_another_watcher_speaks_for_is_left_to_it_then_ended_once_it_does_not(capsys):
    """While the ranks start, the launcher's rank watcher ends the job for a child rank that died, with its
    exit code and last stderr line: the room says nothing then (CI, 6581d93: the room spoke first and the
    launcher's line never came). Once no one else speaks for it, the gone rank ends the job at once."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its PID is not in /proc
    store, exits, asked = CountingStore(), [], []
    speaks = threading.Event()
    speaks.set()

    def defers(verdict, records):
        asked.append((verdict.ranks, verdict.how, [r.pid for r in records if r.rank in verdict.ranks]))
        return speaks.is_set()

    options = {"exit": exits.append, "interval_s": EVERY, "defers": defers}
    rooms = [Liveness(store, rank, 2, NAME, END, **options) for rank in range(2)]
    record = Record(1, 1, 1, "starting", child.pid, rooms[0]._host, "", rooms[0]._ns)
    rooms[1]._write_record = lambda: store.set("ddp_plugins/liveness/1", json.dumps(record._asdict()))
    rooms[1]._publish()
    rooms[0].start()
    assert _wait(lambda: len(asked) >= 3, 5), "the room never judged the gone rank"
    assert asked[0] == ((1,), "gone", [child.pid]), asked[0]
    assert exits == [] and _errors(capsys) == [], "the room spoke for a rank another watcher speaks for"
    speaks.clear()
    assert _wait(lambda: exits == [STALL_EXIT], 5), "a gone rank no one else speaks for did not end the job"
    named = _errors(capsys)[0]
    assert named.startswith(f"error: rank 1 (PID {child.pid} ") and "its process is gone" in named, named
    rooms[0].stop()


def test_a_rank_is_judged_by_its_state_not_by_the_words_of_its_phase():
    """A record's state says whether its rank left or raised (6581d93 read it from the phase's words, so a
    phase named "left", or one beginning "raised ", made a gone rank unjudgeable)."""
    for phase in ("left", "raised the learning rate"):
        records = [Record(0, 5, 9, "a backward", 10, "h"), Record(1, 5, 8, phase, 11, "h")]
        verdict = judge(records, [99, 99], [99, 99], now=100, after_s=30, states=[None, "gone"])
        assert verdict == Verdict((1,), "gone", 1), phase
    left = Record(1, 5, 8, "left", 11, "h", state=RankState.LEFT.value)
    assert judge([Record(0, 5, 9, "a backward", 10, "h"), left], [99, 99], [99, 99], 100, 30, [None, "gone"]) is None
    raised = json.loads(json.dumps(left._replace(state=RankState.RAISED.value)._asdict()))  # as it travels
    assert Record(**raised).state == RankState.RAISED
