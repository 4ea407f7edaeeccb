"""Naming the rank that stopped progressing when a collective fails (``core.stalls``)."""

import torch.distributed as dist

from ddp_plugins.core.stalls import describe_collective_failure, is_collective_failure, stalled_ranks


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
