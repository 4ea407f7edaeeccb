"""The harness itself: real gloo groups, results by rank, a hang fails fast."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.multiprocess import DistributedPool


def _test_all_reduce_equals_sum(rank, world_size):
    t = torch.arange(4, dtype=torch.float32) + rank
    dist.all_reduce(t)
    return t


def test_pool_runs_every_rank_and_matches_single_process_sum(dist_pool):
    results = dist_pool.run(_test_all_reduce_equals_sum)
    expected = sum(torch.arange(4, dtype=torch.float32) + r for r in range(2))
    assert len(results) == 2
    for t in results:
        torch.testing.assert_close(t, expected)


def _test_rank_zero_hangs(rank, world_size):
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(30)
    return rank


def test_hang_fails_fast_and_pool_recovers():
    pool = DistributedPool(world_size=2, timeout=8, pg_timeout=20)
    try:
        start = time.monotonic()
        with pytest.raises(AssertionError, match="hang"):
            pool.run(_test_rank_zero_hangs)
        assert time.monotonic() - start < 30, "the harness timeout did not stop a hang"
        assert pool.run(_test_all_reduce_equals_sum)[1][0] == 1.0, "a fresh group after the hang"
    finally:
        pool.close()
