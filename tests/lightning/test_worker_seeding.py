"""``core.workers``: ``seed_worker`` leaves the generator states Lightning's ``pl_worker_init_function``
leaves, and ``WorkerInit`` takes that function's place."""

import functools
import random

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function

from ddp_plugins.core.workers import WorkerInit, seed_worker
from ddp_plugins.lightning.strategy import _is_lightning_seeding


def _states_after(fn, base_seed, worker_id, rank):
    torch.manual_seed(base_seed + worker_id)  # what torch does in worker `worker_id` before its init function
    fn(worker_id, rank)
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


@pytest.mark.parametrize(("base_seed", "worker_id", "rank"), [(0, 0, 0), (1234, 1, 0), (2**40 + 7, 3, 5), (99, 0, 1)])
def test_seed_worker_leaves_the_states_lightning_s_worker_seeding_leaves(isolated, base_seed, worker_id, rank):
    ours = _states_after(seed_worker, base_seed, worker_id, rank)
    lightning = _states_after(lambda w, r: pl_worker_init_function(w, rank=r), base_seed, worker_id, rank)
    assert torch.equal(ours[0], lightning[0]), "torch's generator differs from Lightning's seeding"
    assert ours[1] == lightning[1], "random's state differs from Lightning's seeding"
    assert ours[2][0] == lightning[2][0] and np.array_equal(ours[2][1], lightning[2][1]), "numpy's state differs"


def test_worker_init_takes_the_place_of_lightning_s_seeding_function():
    replaced = WorkerInit(functools.partial(pl_worker_init_function, rank=3), rank=0, restates=_is_lightning_seeding)
    assert replaced.seed and replaced.user_fn is None and replaced.rank == 3
    again = WorkerInit(replaced, rank=3)
    assert again.seed and again.user_fn is None, "wrapped twice: still seeded once, no function left"
