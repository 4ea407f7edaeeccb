import os

import pytest

from ddp_plugins.core.toolkit import LOOPBACK_ENV
from tests.helpers.multiprocess import DistributedPool
from tests.helpers.rng import Isolated

# Every process these tests start talks gloo over loopback with one thread per rank.
os.environ.update(LOOPBACK_ENV)


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
