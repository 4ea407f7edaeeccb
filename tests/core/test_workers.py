"""DataLoader workers (``core.workers``): Lightning's seeding function replaced, nothing of Lightning imported.

That ``seed_worker`` equals Lightning's seeding, and that Lightning's own function is replaced, is
checked in ``tests/lightning/test_worker_seeding.py`` (on every Lightning version of the matrix).
"""

import subprocess
import sys

from ddp_plugins.core.workers import WorkerInit


def test_worker_init_seeds_as_pl_seed_workers_asks_and_keeps_a_user_s_function(monkeypatch):
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    assert not WorkerInit(None, rank=1).seed
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
