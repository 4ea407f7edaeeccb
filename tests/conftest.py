import gc
import os

import pytest

from ddp_plugins.testing import LOOPBACK_ENV, DistributedPool
from tests.helpers import REPO_ROOT
from tests.helpers.rng import Isolated
from tests.helpers.slurm import SlurmCluster, SlurmUnavailable

# Every process these tests start talks gloo over loopback with one thread per rank, and imports
# tests.* (test callbacks named on the app's command line, rank functions) from any folder.
os.environ.update(LOOPBACK_ENV)
# The CPU suite runs with CUDA hidden, in this process and every process it starts, so that it runs
# and proves the same on a machine with GPUs as on one without (CPU ranks, gloo, the CPU defaults).
# The tests marked `gpu` run with CUDA shown: `make gpu-check` (and `make test` where a GPU is) sets
# DDP_PLUGINS_TEST_CUDA=1 and selects them with `-m gpu`.
SHOW_CUDA = os.environ.get("DDP_PLUGINS_TEST_CUDA") == "1"
if not SHOW_CUDA:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))


def pytest_collection_modifyitems(config, items):
    """A `gpu` test is skipped, with the reason, where it cannot run: CUDA hidden or no GPU here."""
    import torch

    if not SHOW_CUDA:
        reason = "CUDA is hidden from the CPU suite; `make gpu-check` runs the gpu tests on a machine with a GPU"
    elif not torch.cuda.is_available():
        reason = "needs a CUDA GPU: none on this machine"
    else:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def dist_pool():
    """Two spawned ranks in one gloo group, shared by the fast collective tests."""
    pool = DistributedPool(world_size=2, timeout=90.0)
    yield pool
    pool.close()


@pytest.fixture
def isolated():
    """Global RNGs, the seeding environment variables and torch's determinism flags restored after the test."""
    with Isolated():
        yield


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A private one-node Slurm cluster (tests/helpers/slurm.py), installed and started if needed;
    every client these tests run (sbatch, scontrol, submitit) finds it through ``SLURM_CONF``. One
    per pytest-xdist worker that runs a Slurm test: the clusters share nothing (ports, state and
    job ids are each their own)."""
    try:
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).__enter__()
    except SlurmUnavailable as error:  # no root, no apt, or a system Slurm already runs here
        pytest.skip(f"no Slurm test cluster: {error}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(cluster.conf))
        try:
            yield cluster
        finally:
            cluster.stop()


# Under pytest-xdist (make test and make matrix run three workers, the Makefile's XDIST) the app runs
# that tests on several workers compare with are made once per test run (tests/helpers/shared.py).
# xdist_group marks are not used: with pytest 9.2, `--dist loadgroup` silently stops grouping
# (pytest-xdist issue 1386).


# Variables of launchers and schedulers that would change which cluster environment Lightning detects.
CLUSTER_VARS = (
    "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "KUBERNETES_PORT", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NAME",
    "SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NNODES", "SLURM_JOB_ID", "PL_GLOBAL_SEED",
)  # fmt: skip


@pytest.fixture
def clean_process_state(monkeypatch):
    """For a test that fits a Trainer of the pack's strategy in the pytest process: no cluster variables
    in, nothing the strategy or launchers write to os.environ out, rank 0 again, and no process group
    left behind (a later test in the same worker would find a group, and its port taken)."""
    import torch.distributed as dist
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as pytorch_rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    from ddp_plugins.lightning.network import restore_env

    for key in CLUSTER_VARS:
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    # `set_world_ranks` (run when a Trainer is built) sets the rank-zero rank globally
    for holder in {id(x): x for x in (fabric_rank_zero_only, pytorch_rank_zero_only, utils_rank_zero_only)}.values():
        monkeypatch.setattr(holder, "rank", 0, raising=False)
    yield
    if dist.is_initialized():
        gc.collect()  # the DDP wrappers of the test are gone before their group is
        dist.destroy_process_group()
    restore_env(before)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A default process group a test leaves in the pytest process holds its port and makes every later
    test in that worker distributed; destroyed after the test whatever the test did (the in-process
    Trainer tests also use ``clean_process_state``, which restores the environment too)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
