"""A distinct, reproducible random stream per rank, and every generator's state collected and restored."""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ddp_plugins.core.checks import check_bool, check_int
from ddp_plugins.core.ranks import get_rank

__all__ = [
    "MAX_SEED",
    "check_seed",
    "collect_rng_states",
    "decode_rng_states",
    "encode_rng_states",
    "isolated_rng",
    "rank_seed",
    "seed_everything_rank_aware",
    "seed_process",
    "set_deterministic",
    "set_rng_states",
]

log = logging.getLogger(__name__)

MAX_SEED = 2**32 - 1  # NumPy's legacy generator takes a uint32 seed; Python and torch accept more


def seed_everything_rank_aware(
    seed: int, workers: bool = True, deterministic: bool = False, *, rank: int | None = None
) -> int:
    """Seed Python, NumPy and torch in this process with a seed derived from ``(seed, rank)``; return that seed.

    By hand: ``lightning.seed_everything`` gives every rank the same seed. With a Trainer use
    :class:`RankAwareSeed` (the DDP strategy reseeds every rank at setup); docs/design.md, "Seeding per rank".

    Args:
        seed: the base seed, shared by all ranks, in ``[0, 2**32 - 1]``.
        workers: set ``PL_SEED_WORKERS``: the Trainer seeds DataLoader workers per (seed, rank, worker, epoch).
        deterministic: also call :func:`set_deterministic`.
        rank: the global rank; by default :func:`ddp_plugins.core.get_rank`.

    Example::

        >>> s0 = seed_everything_rank_aware(42, rank=0)
        >>> s1 = seed_everything_rank_aware(42, rank=1)
        >>> s0 != s1 and s0 == seed_everything_rank_aware(42, rank=0)
        True
    """
    seed = check_seed(seed)
    check_bool("workers", workers)
    check_bool("deterministic", deterministic)
    rank = get_rank() if rank is None else check_int("rank", rank, 0)
    if deterministic:
        set_deterministic()
    process_seed = rank_seed(seed, rank)
    seed_process(seed, process_seed, workers)
    log.info("[rank %d] Seed set to %d (seed %d, rank %d)", rank, process_seed, seed, rank)
    return process_seed


def check_seed(seed: Any) -> int:
    """``seed`` as an int when it is in ``[0, 2**32 - 1]``, the range NumPy's generator accepts."""
    return check_int("seed", seed, 0, MAX_SEED)


def rank_seed(seed: int, *key: int) -> int:
    """The seed of the child of ``SeedSequence(seed)`` with spawn key ``key`` (e.g. ``(rank,)``).

    Example::

        >>> rank_seed(42, 0) != rank_seed(42, 1)
        True
    """
    return int(np.random.SeedSequence(seed, spawn_key=key).generate_state(1, np.uint32)[0])


def seed_process(base_seed: int, process_seed: int, workers: bool) -> None:
    """Seed Python, NumPy and torch with ``process_seed``; ``PL_GLOBAL_SEED``, every rank's, stays ``base_seed``."""
    random.seed(process_seed)
    np.random.seed(process_seed)
    torch.manual_seed(process_seed)  # every CUDA device too
    os.environ["PL_GLOBAL_SEED"] = str(base_seed)
    os.environ["PL_SEED_WORKERS"] = str(int(workers))


@contextlib.contextmanager
def isolated_rng(seed: int) -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU) global generators seeded with ``seed`` in the block, restored after it.

    Example::

        >>> before = torch.get_rng_state()
        >>> with isolated_rng(3):
        ...     first = torch.rand(2)
        >>> with isolated_rng(3):
        ...     again = torch.rand(2)
        >>> torch.equal(first, again) and torch.equal(torch.get_rng_state(), before)
        True
    """
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # the CPU generator only: CUDA streams are not touched
        random.seed(seed)
        np.random.seed(seed % (MAX_SEED + 1))
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def set_deterministic() -> None:
    """The flags ``Trainer(deterministic=True)`` sets, available without a Trainer."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # ":16:8" is valid too; keep the user's
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def collect_rng_states(include_cuda: bool = True) -> dict[str, Any]:
    """This process's Python, NumPy, torch (and CUDA) generator states, from their public getters.

    Example::

        >>> states = collect_rng_states()
        >>> first = torch.rand(1)
        >>> set_rng_states(states)
        >>> torch.equal(torch.rand(1), first)
        True
    """
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if include_cuda:
        states["torch.cuda"] = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`collect_rng_states` (or :func:`decode_rng_states`) returned.

    Example::

        >>> states = collect_rng_states()
        >>> first = torch.rand(3)
        >>> set_rng_states(states)
        >>> torch.equal(torch.rand(3), first)
        True
    """
    torch.set_rng_state(states["torch"])
    if "torch.cuda" in states:
        torch.cuda.set_rng_state_all(states["torch.cuda"])
    if "numpy" in states:
        np.random.set_state(states["numpy"])
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))


def encode_rng_states(states: dict[str, Any]) -> dict[str, Any]:
    """:func:`collect_rng_states` with NumPy's state as tensors and plain numbers, for ``weights_only`` loads.

    Example::

        >>> encoded = encode_rng_states(collect_rng_states())
        >>> type(encoded["numpy"]["keys"]).__name__
        'Tensor'
    """
    states = dict(states)
    if "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        states["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return states


def decode_rng_states(states: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`encode_rng_states`; CUDA states saved with other devices are dropped.

    Example::

        >>> states = decode_rng_states(encode_rng_states(collect_rng_states()))
        >>> first = torch.rand(2)
        >>> set_rng_states(states)
        >>> torch.equal(torch.rand(2), first)
        True
    """
    states = dict(states)
    numpy_state = states.get("numpy")
    if isinstance(numpy_state, dict):
        keys = numpy_state["keys"].numpy().astype(np.uint32)
        rest = (numpy_state[key] for key in ("pos", "has_gauss", "cached_gaussian"))
        states["numpy"] = (numpy_state["name"], keys, *rest)
    if len(states.get("torch.cuda") or []) != (torch.cuda.device_count() if torch.cuda.is_available() else 0):
        states.pop("torch.cuda", None)  # saved with other CUDA devices: keep the torch.manual_seed ones
    return states
