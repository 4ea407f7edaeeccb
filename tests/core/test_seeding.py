"""Rank-aware seeding (core): distinct streams per rank, reproducible runs, RNG states that round-trip.

The Lightning callback (RankAwareSeed: worker streams, exact resume) is tested in
tests/lightning/test_rank_aware_seed.py.
"""

from __future__ import annotations

import io
import os
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ddp_plugins.core.seeding import (
    collect_rng_states,
    decode_rng_states,
    encode_rng_states,
    seed_everything_rank_aware,
    set_rng_states,
)
from tests.helpers.rng import BAD_SEEDS, Isolated, assert_all_differ, draw, same

# ---------------------------------------------------------------------------------------------
# 2 gloo ranks (dist_pool)


def _test_draws(rank, world_size, seed):
    dist.barrier()  # the pool hands each rank one call only when the call needs every rank
    with Isolated():
        returned = seed_everything_rank_aware(seed)
        return returned, draw(), os.environ["PL_GLOBAL_SEED"], os.environ["PL_SEED_WORKERS"]


def test_draws_differ_across_ranks_repeat_per_seed_and_match_single_process(dist_pool, isolated):
    run_a = dist_pool.run(_test_draws, 42)
    run_b = dist_pool.run(_test_draws, 42)
    other = dist_pool.run(_test_draws, 7)

    (seed0, draws0, *_), (seed1, draws1, *_) = run_a
    assert seed0 != seed1, "both ranks got the same seed"
    assert_all_differ(draws0, draws1, "on rank 0 and rank 1")
    for rank in range(2):
        assert run_a[rank][0] == run_b[rank][0] and same(run_a[rank][1], run_b[rank][1]), (
            f"rank {rank}: two runs with seed 42 drew differently"
        )
        assert_all_differ(run_a[rank][1], other[rank][1], f"on rank {rank} with seeds 42 and 7")
        # DistributedSampler is seeded from PL_GLOBAL_SEED: it must stay the shared base seed.
        assert run_a[rank][2:] == ("42", "1"), f"rank {rank}: PL_GLOBAL_SEED/PL_SEED_WORKERS {run_a[rank][2:]}"
        # single-process reference: the stream depends on (seed, rank) only
        assert seed_everything_rank_aware(42, rank=rank) == run_a[rank][0]
        assert same(draw(), run_a[rank][1]), f"rank {rank}'s stream differs from the single-process one"


# ---------------------------------------------------------------------------------------------
# one process


def test_single_process_is_rank_zero(isolated):
    seed = seed_everything_rank_aware(3)
    draws = draw()
    assert seed == seed_everything_rank_aware(3, rank=0)
    assert same(draws, draw())
    assert os.environ["PL_GLOBAL_SEED"] == "3"


def test_deterministic_sets_torch_flags(isolated):
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    seed_everything_rank_aware(1, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled(), "deterministic=False changed the flags"
    seed_everything_rank_aware(1, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@pytest.mark.parametrize(("seed", "error"), BAD_SEEDS)
def test_seed_out_of_range_is_a_clear_error(seed, error):
    message = rf"^`seed` should be an integer in \[0, 4294967295\], got {re.escape(repr(seed))}\.$"
    with pytest.raises(error, match=message):
        seed_everything_rank_aware(seed)


def test_bad_flags_and_rank_are_clear_errors():
    with pytest.raises(TypeError, match=r"^`workers` should be True or False, got 'yes'\.$"):
        seed_everything_rank_aware(1, workers="yes")
    with pytest.raises(TypeError, match=r"^`deterministic` should be True or False, got 1\.$"):
        seed_everything_rank_aware(1, deterministic=1)
    with pytest.raises(ValueError, match=r"^`rank` should be an integer >= 0, got -1\.$"):
        seed_everything_rank_aware(1, rank=-1)


def test_seed_boundaries_are_accepted(isolated):
    seed_everything_rank_aware(0)
    seed_everything_rank_aware(2**32 - 1, rank=5)


def test_rng_states_round_trip_through_a_weights_only_checkpoint(isolated):
    seed_everything_rank_aware(5, rank=1)
    np.random.randn()  # caches a gaussian in NumPy's legacy state
    states = collect_rng_states()
    expected = draw()
    seed_everything_rank_aware(99)  # scramble
    buffer = io.BytesIO()
    torch.save(encode_rng_states(states), buffer)
    buffer.seek(0)
    set_rng_states(decode_rng_states(torch.load(buffer, weights_only=True)))
    assert same(draw(), expected), "the restored states do not continue the saved streams"
