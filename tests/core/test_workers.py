"""DataLoader workers (``core.workers``): Lightning's seeding restated exactly, without importing Lightning."""

import functools
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from ddp_plugins.core.workers import WorkerInit, seed_worker


def _states_after(fn, base_seed, worker_id, rank):
    torch.manual_seed(base_seed + worker_id)  # what torch does in worker `worker_id` before its init function
    fn(worker_id, rank)
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


@pytest.mark.parametrize(("base_seed", "worker_id", "rank"), [(0, 0, 0), (1234, 1, 0), (2**40 + 7, 3, 5), (99, 0, 1)])
def test_seed_worker_leaves_the_states_lightning_s_worker_seeding_leaves(isolated, base_seed, worker_id, rank):
    from lightning.fabric.utilities.seed import pl_worker_init_function

    ours = _states_after(seed_worker, base_seed, worker_id, rank)
    lightning = _states_after(lambda w, r: pl_worker_init_function(w, rank=r), base_seed, worker_id, rank)
    assert torch.equal(ours[0], lightning[0]), "torch's generator differs from Lightning's seeding"
    assert ours[1] == lightning[1], "random's state differs from Lightning's seeding"
    assert ours[2][0] == lightning[2][0] and np.array_equal(ours[2][1], lightning[2][1]), "numpy's state differs"


def test_worker_init_takes_the_place_of_lightning_s_seeding_function_and_keeps_a_user_s(monkeypatch):
    from lightning.fabric.utilities.seed import pl_worker_init_function

    replaced = WorkerInit(functools.partial(pl_worker_init_function, rank=3), rank=0)
    assert replaced.seed and replaced.user_fn is None and replaced.rank == 3
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    assert WorkerInit(None, rank=1).seed, "PL_SEED_WORKERS with no function: Lightning's seeding, restated"
    mine = print
    kept = WorkerInit(WorkerInit(mine, rank=1), rank=1)
    assert kept.user_fn is mine and not kept.seed, "a user's function is called as it is, once"


def test_what_a_forkserver_worker_imports_does_not_import_lightning():
    code = (
        "import sys, torch, ddp_plugins.core.workers, ddp_plugins.train\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', 'pytorch_lightning', 'hydra'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
