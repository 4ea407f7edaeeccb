"""The liveness room at start-up, on real gloo ranks: the room never shares the store client the
training thread rendezvouses on, so a rendezvous (``new_group``: gloo's full-mesh connect through the
default store) is never held up by it, and a rank that waits in one is never named.

On a1c30de both cases hung or named a healthy rank: rank 1's room read rank 0's record with a blocking
``get`` on the training thread's client, holding the client's lock, while rank 0's training thread
waited (holding its own client) for rank 1's address."""

from __future__ import annotations

import io
import sys
import threading
import time

import pytest
import torch.distributed as dist

from ddp_plugins import _compat
from ddp_plugins.core.liveness import Liveness
from ddp_plugins.testing import spawn

ROUNDS = 20


def _startup_rank(rank: int, world_size: int, case: str) -> tuple[list[float], str, bool]:
    """``ROUNDS`` rendezvous of a new group each; rank 0's room starts late ("late room": rank 0 was still
    setting up) or rank 0 works past the naming limit before each of the first two rendezvous ("slow setup")."""
    sys.stderr = err = io.StringIO()  # what the room prints (it looks up sys.stderr when it prints)
    ended: list[int] = []
    room = Liveness(_compat.default_store(), rank, world_size, 1.0, None, interval_s=0.1, exit=ended.append)
    if rank == 0 and case == "late room":
        threading.Timer(0.5, room.start).start()  # this rank's training thread is in the rendezvous by then
    else:
        room.start()
        time.sleep(0.2)  # the other rank's room has read (or waits for) rank 0's record
    took = []
    for round_ in range(ROUNDS):
        if rank == 0 and case == "slow setup" and round_ < 2:
            time.sleep(2.5)  # past the naming limit (1 s), as rank 0 working 30 s in `setup` with the default 30 s
        start = time.monotonic()
        dist.barrier(group=dist.new_group())
        took.append(time.monotonic() - start)
    dist.barrier()
    room.stop()
    return took, err.getvalue(), bool(ended)


@pytest.mark.parametrize("case", ["late room", "slow setup"])
def test_a_rendezvous_is_never_held_up_by_the_room_and_a_rank_waiting_in_one_is_not_named(case):
    results = spawn(_startup_rank, case, world_size=2, timeout=60, pg_timeout=20)
    for rank, (took, printed, ended) in enumerate(results):
        slow = max(took[2:] if case == "slow setup" else took)  # the first two wait for rank 0 on purpose
        assert slow < 5.0, f"rank {rank}: a rendezvous took {slow:.1f} s: it waited for the room's store call"
        assert printed == "", f"rank {rank}'s room named a healthy rank:\n{printed}"
        assert not ended, f"rank {rank}'s room ended a healthy job"
