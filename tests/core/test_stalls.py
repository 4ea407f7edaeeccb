"""Naming the rank that stopped progressing when a collective fails (``core.stalls``)."""

import os
import time

import torch.distributed as dist

from ddp_plugins.core.stalls import describe_collective_failure, is_collective_failure, stalled_ranks
from ddp_plugins.core.watchdog import STALL_EXIT, ProgressWatchdog, Stall


def test_gloo_and_nccl_failures_are_recognised_and_others_are_not():
    for message in (
        "Application timeout caused pair closure",
        "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms for recv operation to complete",
        "[../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41602: Connection reset by peer",
        "NCCL communicator was aborted on rank 1.",
    ):
        assert is_collective_failure(RuntimeError(message)), message
    assert not is_collective_failure(RuntimeError("CUDA out of memory"))
    assert not is_collective_failure(KeyboardInterrupt("Timed out"))


def test_the_ranks_that_never_record_a_failure_are_the_stalled_ones():
    store = dist.HashStore()
    stalled_ranks(store, 3, 4, tag="7", grace_s=0)
    stalled_ranks(store, 1, 4, tag="6", grace_s=0)  # an earlier failure, another step: does not count
    assert stalled_ranks(store, 0, 4, tag="7", grace_s=0.2) == [1, 2]


def test_every_rank_failing_is_a_mismatch_not_a_stall_and_the_answer_is_asked_once():
    store = dist.HashStore()
    stalled_ranks(store, 1, 2, grace_s=0)
    error = RuntimeError("Connection closed by peer")
    note = describe_collective_failure(error, store, 0, 2, grace_s=0.2)
    assert note.startswith("every rank failed in a collective (rank 0 too), none stopped elsewhere")
    store.delete_key("ddp_plugins/failed_in_collective/1")
    assert describe_collective_failure(error, store, 0, 2, grace_s=0.2) == note, "kept on the error"
    assert describe_collective_failure(ValueError("bad batch"), store, 0, 2) is None


def test_a_store_that_cannot_answer_gives_no_diagnosis():
    class GoneStore:
        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")

    assert describe_collective_failure(RuntimeError("Timed out"), GoneStore(), 0, 2, grace_s=0) is None


# ---------------------------------------------------------------- the progress watchdog


def _watch(store, rank, exits, after_s=0.6):
    return ProgressWatchdog(store, rank, 2, after_s=after_s, interval_s=0.1, exit=exits.append)


def test_a_rank_stuck_with_its_process_alive_is_named_by_the_other_and_every_rank_ends(tmp_path, capsys):
    """Rank 1's heartbeats go on (a loader or I/O holds its training thread) but it begins no step;
    rank 0 began one more and waits: rank 1 is named, the dump written, both watchdogs end the job."""
    store, exits = dist.HashStore(), []
    watchdogs = [_watch(store, 0, exits), _watch(store, 1, exits)]
    watchdogs[0].dump_dir = tmp_path
    for watchdog in watchdogs:
        watchdog.beat("a training step (global step 7)")
        watchdog.start()
    watchdogs[0].beat("a training step (global step 8)")  # rank 0 went on to the next step's collective
    deadline = time.monotonic() + 10
    while len(exits) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    for watchdog in watchdogs:
        watchdog.stop()
    assert exits == [STALL_EXIT, STALL_EXIT], "every rank must end the job"
    assert watchdogs[0].stall == Stall((1,), False, watchdogs[0].stall.seconds)
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"error: rank 1 (PID {os.getpid()} on ") and "global step 7): it stopped progressing" in line
    assert "rank 1" in (tmp_path / "stall.txt").read_text()


def test_ranks_in_one_long_step_are_left_alone(capsys):
    store, exits = dist.HashStore(), []
    watchdogs = [_watch(store, 0, exits, after_s=0.3), _watch(store, 1, exits, after_s=0.3)]
    for watchdog in watchdogs:
        watchdog.beat("a training step (global step 0)")  # a first step that compiles, on every rank
        watchdog.start()
    time.sleep(1.5)
    for watchdog in watchdogs:
        watchdog.stop()
    assert exits == [] and capsys.readouterr().err == ""
