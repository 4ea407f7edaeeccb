"""DataLoader workers of a DDP rank: set-up, seeding, leaving with the rank (plain torch: no Lightning in workers)."""

from __future__ import annotations

import functools
import os
import random
import select
import signal
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["WorkerInit", "seed_worker"]

_MASK64 = (1 << 64) - 1


def seed_worker(worker_id: int, rank: int) -> None:
    """Seed torch, ``random`` and numpy in a DataLoader worker exactly as Lightning's ``pl_worker_init_function``.

    Restated so that workers import no Lightning (seconds per forkserver); a test holds the two equal.

    Example::

        >>> _ = torch.manual_seed(1000 + 1)  # what torch sets in worker 1 of a loader with base seed 1000
        >>> seed_worker(1, rank=0)
        >>> first = torch.rand(1)
        >>> _ = torch.manual_seed(1000 + 1)
        >>> seed_worker(1, rank=0)
        >>> torch.equal(first, torch.rand(1))
        True
    """
    base_seed = torch.initial_seed() - worker_id  # torch seeds worker i with base_seed + i
    # MurmurHash3's finalizer on (base seed, worker, rank), then a 64-bit LCG (Knuth's constant)
    mixed = (base_seed << 32) | (worker_id << 16) | rank
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        mixed ^= mixed >> 33
        mixed = (mixed * multiplier) & _MASK64
    mixed ^= mixed >> 33
    seeds = []
    for _ in range(3):
        mixed = (mixed * 6364136223846793005 + 1) & _MASK64
        seeds.append(mixed)
    torch.manual_seed(seeds[0])
    random.seed((seeds[1] << 32) | seeds[2])
    np.random.seed(np.random.SeedSequence([base_seed, worker_id, rank]).generate_state(4))


class WorkerInit:
    """A DataLoader ``worker_init_fn`` for a DDP rank: stop signals ignored, a watch on the rank, seeding, user's fn.

    The ranks stop at a step boundary, so a signal to the process group must not kill workers; a forkserver's worker
    leaves when its rank dies (a pidfd).

    Args:
        user_fn: the loader's ``worker_init_fn`` (None, the user's, or a trainer's seeding function).
        restates: whether a ``functools.partial``'s ``func`` (``rank`` keyword) is one :func:`seed_worker` restates.

    Example::

        >>> init = WorkerInit(None, rank=1)
        >>> init.user_fn is None and init.rank == 1
        True
    """

    seed: bool
    user_fn: Callable[[int], Any] | None

    def __init__(
        self, user_fn: Callable[[int], Any] | None, rank: int, restates: Callable[[Any], bool] | None = None
    ) -> None:
        seed = False
        if isinstance(user_fn, WorkerInit):  # wrapped again (a loader set up twice): one set-up
            seed, user_fn = user_fn.seed, user_fn.user_fn
        if isinstance(user_fn, functools.partial) and restates is not None and restates(user_fn.func):
            seed, rank, user_fn = True, user_fn.keywords.get("rank", rank), None
        # as Lightning's own loader set-up: PL_SEED_WORKERS seeds the workers of a loader with no function
        self.seed = seed or (user_fn is None and bool(int(os.environ.get("PL_SEED_WORKERS", 0))))
        self.user_fn = user_fn
        self.rank = rank
        self.rank_pid = os.getpid()

    def __call__(self, worker_id: int) -> None:
        for name in ("SIGTERM", "SIGINT", "SIGUSR1"):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        if os.getppid() != self.rank_pid:
            _leave_when_gone(self.rank_pid)
        if self.seed:
            seed_worker(worker_id, self.rank)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _leave_when_gone(pid: int) -> None:
    """End this process (``os._exit(0)``) as soon as process ``pid`` has ended (a daemon thread)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # already gone
        os._exit(0)

    def watch() -> None:
        select.select([fd], [], [])
        os._exit(0)

    threading.Thread(target=watch, name="rank-watch", daemon=True).start()
