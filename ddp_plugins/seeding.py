r"""Rank-aware seeding.

``lightning.seed_everything(s)`` gives every rank the same seed, so random augmentations, dropout
masks and sampled noise repeat on every rank (Lightning issue 16166: a GAN samples the same latent
on every GPU), and N ranks see less randomness than one process on the global batch would.
This module gives every rank its own stream, keeps the model initialization identical on every
rank, and makes a resumed run continue exactly where the interrupted one stopped.

* :func:`seed_everything_rank_aware` seeds Python, NumPy and torch (CPU and every CUDA device) in
  the current process with the seed of ``(seed, global rank)``: the ``rank``-th child of
  ``numpy.random.SeedSequence(seed)``, i.e. ``SeedSequence(seed).spawn(world_size)[rank]``.
  Children of a ``SeedSequence`` are designed to be statistically independent; ``seed + rank``
  (timm's ``init_seeds(1 + rank)``) is not, since seed 1 rank 1 equals seed 2 rank 0.
* :class:`RankAwareSeed` is the Lightning adapter: the base seed while the model is set up, the
  rank's own stream from ``on_fit_start``, and every rank's RNG states in the checkpoint.

What is reused from Lightning and what is added:

* Seeding goes through :func:`lightning.fabric.utilities.seed.seed_everything` with the derived
  seed, so ``PL_SEED_WORKERS`` works as usual: the Trainer adds
  :func:`~lightning.fabric.utilities.seed.pl_worker_init_function` to its DataLoaders, which mixes
  the worker id and the global rank into the worker seeds. The worker base seed is drawn from the
  rank's torch stream when each epoch's iterator is created, so worker streams differ per
  (seed, rank, worker id, epoch). Plain DataLoaders get the same property from torch's own
  worker seeding (``base_seed + worker_id``, base seed drawn from the per-rank stream).
* ``PL_GLOBAL_SEED`` keeps the *base* seed on every rank: Lightning seeds ``DistributedSampler``
  with it, and different seeds per rank would shuffle differently on each rank, so the shards
  would overlap. Lightning's DDP strategy also calls ``reset_seed()`` (base seed on every rank)
  when it sets up; that is why, with a Trainer, the switch to per-rank streams is done by the
  callback at ``on_fit_start`` and not by calling the function before ``fit``.
* RNG states are collected with Lightning's ``_collect_rng_states``; added here: gathering every
  rank's states into the checkpoint (Lightning's Trainer saves none) and storing NumPy's state as a
  tensor, because ``torch.load(weights_only=True)``, the default when the Trainer resumes under
  torch >= 2.6, refuses NumPy arrays.

Exact resume holds for checkpoints saved at epoch ends (or after validation) with
``persistent_workers=False``: persistent DataLoader workers keep their streams in their own
processes, which no checkpoint can capture. Lightning 2.5.3+ also iterates the first resumed
epoch of a shuffled DataLoader with workers in epoch 0's order (Lightning issue 21938), a data
order bug no RNG state can fix; the callback warns when a resumed run meets it.
"""

from __future__ import annotations

import logging
import operator
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_prefixed_message, rank_zero_only, rank_zero_warn
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states, seed_everything
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader
from typing_extensions import override

from ddp_plugins.distributed import get_world_size

__all__ = ["RankAwareSeed", "seed_everything_rank_aware"]

log = logging.getLogger(__name__)

MAX_SEED = 2**32 - 1  # NumPy's legacy generator takes a uint32 seed; Python and torch accept more


def seed_everything_rank_aware(
    seed: int, workers: bool = True, deterministic: bool = False, *, rank: int | None = None
) -> int:
    """Seed Python, NumPy and torch in this process with a seed derived from ``(seed, rank)``.

    Every rank gets a distinct, reproducible stream; one process is rank 0. ``PL_GLOBAL_SEED``
    stays ``seed`` on every rank (Lightning's ``DistributedSampler`` must shuffle alike on all
    ranks). With a Lightning Trainer use :class:`RankAwareSeed` instead: the DDP strategy reseeds
    every rank with ``PL_GLOBAL_SEED`` when it sets up.

    Args:
        seed: the base seed, shared by all ranks, in ``[0, 2**32 - 1]``.
        workers: set ``PL_SEED_WORKERS`` so the Trainer seeds DataLoader workers per
            (seed, rank, worker id, epoch) with ``pl_worker_init_function``.
        deterministic: also make torch use deterministic algorithms: ``torch.use_deterministic_algorithms``,
            cuDNN deterministic and not benchmarking, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set.
        rank: the global rank; by default the process group's rank, else Lightning's
            ``rank_zero_only.rank`` (read from ``RANK``/``LOCAL_RANK``/``SLURM_PROCID``), else 0.

    Returns:
        The seed this process was seeded with.

    Raises:
        ValueError: ``seed`` or ``rank`` out of range, or ``workers``/``deterministic`` not a bool.

    Example::

        >>> s0 = seed_everything_rank_aware(42, rank=0)
        >>> s1 = seed_everything_rank_aware(42, rank=1)
        >>> s0 != s1 and s0 == seed_everything_rank_aware(42, rank=0)
        True
    """
    seed = _check_seed(seed)
    _check_bool("workers", workers)
    _check_bool("deterministic", deterministic)
    rank = _current_rank() if rank is None else _check_rank(rank)
    if deterministic:
        _set_deterministic()
    rank_seed = _rank_seed(seed, rank)
    _seed_process(seed, rank_seed, workers)
    log.info(rank_prefixed_message(f"Seed set to {rank_seed} (seed {seed}, rank {rank})", rank))
    return rank_seed


class RankAwareSeed(Callback):
    """Identical model initialization on every rank, then a distinct random stream per rank.

    How the model stays identical on every rank:

    1. ``setup`` seeds every rank with the base ``seed``, so whatever the ``setup`` and
       ``configure_model`` hooks draw (lazy layers, sharded init) is the same on all ranks.
    2. DDP broadcasts rank 0's parameters and buffers to all ranks when it wraps the model, so a
       model built before ``fit`` is identical when training starts even if it was built under
       different seeds. Seeding with ``lightning.seed_everything(seed)`` before building the model
       keeps rank 0's initialization itself reproducible.

    At ``on_fit_start`` (after DDP's broadcast, before the sanity check, which Lightning runs in
    ``isolate_rng``, and before the first epoch's DataLoader iterator draws its worker base seed)
    every rank switches to its own stream, seeded as :func:`seed_everything_rank_aware` does.
    ``validate``, ``test`` and ``predict`` runs switch when their loop starts.

    Every checkpoint stores the RNG states (Python, NumPy, torch, CUDA) of every rank, gathered
    when the checkpoint is written; on resume each rank restores its own, so the resumed run draws
    exactly what the uninterrupted run would have. A checkpoint written with another world size
    (or without this callback) cannot be matched rank for rank: the run warns and starts fresh
    per-rank streams keyed by ``(seed, rank, global_step)``, so it does not replay the streams of
    the first epoch.

    Args:
        seed: the base seed, shared by all ranks, in ``[0, 2**32 - 1]``.
        workers: seed DataLoader workers per (seed, rank, worker id, epoch), see
            :func:`seed_everything_rank_aware`.
        deterministic: also set torch's deterministic-algorithm flags in ``setup``.

    Raises:
        ValueError: ``seed`` out of range, or ``workers``/``deterministic`` not a bool.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[RankAwareSeed(seed=42)], logger=False)
    """

    def __init__(self, seed: int, workers: bool = True, deterministic: bool = False) -> None:
        self.seed = _check_seed(seed)
        self.workers = _check_bool("workers", workers)
        self.deterministic = _check_bool("deterministic", deterministic)
        self._trainer: Trainer | None = None
        self._started = False
        self._resume_step: int | None = None
        self._loaded: dict[str, Any] | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer, self._started = trainer, False
        if self.deterministic:
            _set_deterministic()
        _seed_process(self.seed, self.seed, self.workers)  # identical on every rank until fit starts

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._resume_step = int(checkpoint.get("global_step", 0))

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started = True
        self._start_streams(trainer)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning issue 21938 (2.5.3+): on resume, the first epoch's iterator is created before the
        # sampler's epoch is set; with workers it draws the indices of epoch 0 at once.
        if not self._resume_step:
            return
        stale: list[DataLoader] = []
        apply_to_collection(
            trainer.train_dataloader, DataLoader, lambda dl: stale.append(dl) if _stale_shuffle(dl, trainer) else None
        )
        if stale:
            rank_zero_warn(
                f"The random streams were restored, but Lightning iterates the first resumed epoch"
                f" ({trainer.current_epoch}) of a shuffled DataLoader with `num_workers` > 0 in the order of"
                " epoch 0 (Lightning issue 21938), so the run is not an exact continuation. Use"
                " `num_workers=0` or a Lightning release with the fix for exact resume."
            )

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:  # during fit the training stream continues
            self._seed_rank(trainer.global_rank, 0)

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._seed_rank(trainer.global_rank, 0)

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._seed_rank(trainer.global_rank, 0)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer, self._started, self._resume_step, self._loaded = None, False, None, None

    @override
    def state_dict(self) -> dict[str, Any]:
        # Called on every rank while the checkpoint is dumped (Trainer.save_checkpoint runs on all
        # ranks); rank 0 writes the file, so it needs every rank's states.
        states = _encode_states(_collect_rng_states(include_cuda=True))
        world_size = get_world_size()
        if world_size > 1:
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, states)
        else:
            gathered = [states]
        return {"seed": self.seed, "world_size": world_size, "rng_states": gathered}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)
        if self._started and self._trainer is not None:  # strategies that restore after setup (FSDP, DeepSpeed)
            self._start_streams(self._trainer)

    def _start_streams(self, trainer: Trainer) -> None:
        loaded, self._loaded = self._loaded, None
        rank, world_size, step = trainer.global_rank, trainer.world_size, self._resume_step or 0
        if loaded is None:
            if step > 0:
                rank_zero_warn(
                    f"The checkpoint holds no `{type(self).__name__}` random states; starting fresh"
                    f" per-rank streams (seed {self.seed}, step {step}), not an exact continuation."
                )
            self._seed_rank(rank, step)
            return
        states = loaded.get("rng_states") or []
        if len(states) != world_size:
            rank_zero_warn(
                f"The checkpoint holds random states for {len(states)} ranks, this run has {world_size};"
                f" starting fresh per-rank streams (seed {self.seed}, step {step}), not an exact continuation."
            )
            self._seed_rank(rank, step)
            return
        if loaded.get("seed", self.seed) != self.seed:
            rank_zero_warn(
                f"Resuming the random streams of seed {loaded.get('seed')} from the checkpoint;"
                f" `seed`={self.seed} applies to fresh runs only."
            )
        _set_rng_states(_decode_states(states[rank]))

    def _seed_rank(self, rank: int, step: int) -> None:
        key = (rank,) if step == 0 else (rank, step)
        _seed_process(self.seed, _rank_seed(self.seed, *key), self.workers)


def _stale_shuffle(dataloader: DataLoader, trainer: Trainer) -> bool:
    sampler = getattr(dataloader.batch_sampler, "sampler", dataloader.sampler)
    return (
        dataloader.num_workers > 0
        and getattr(sampler, "shuffle", False)
        and getattr(sampler, "epoch", trainer.current_epoch) != trainer.current_epoch
    )


def _rank_seed(seed: int, *key: int) -> int:
    """The seed of the child of ``SeedSequence(seed)`` with spawn key ``key`` (e.g. ``(rank,)``)."""
    return int(np.random.SeedSequence(seed, spawn_key=key).generate_state(1, np.uint32)[0])


def _seed_process(base_seed: int, process_seed: int, workers: bool) -> None:
    seed_everything(process_seed, workers=workers, verbose=False)
    os.environ["PL_GLOBAL_SEED"] = str(base_seed)  # shared: DistributedSampler and reset_seed()


def _set_deterministic() -> None:
    # The flags `Trainer(deterministic=True)` sets, available without a Trainer.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # ":16:8" is valid too; keep the user's
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _current_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return getattr(rank_zero_only, "rank", None) or 0


def _encode_states(states: dict[str, Any]) -> dict[str, Any]:
    """Lightning's RNG states with NumPy's as tensors and plain numbers (``weights_only``-loadable)."""
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


def _decode_states(states: dict[str, Any]) -> dict[str, Any]:
    states = dict(states)
    numpy_state = states.get("numpy")
    if isinstance(numpy_state, dict):
        keys = numpy_state["keys"].numpy().astype(np.uint32)
        states["numpy"] = (
            numpy_state["name"], keys, numpy_state["pos"], numpy_state["has_gauss"], numpy_state["cached_gaussian"]
        )
    cuda_states = states.get("torch.cuda") or []
    if len(cuda_states) != (torch.cuda.device_count() if torch.cuda.is_available() else 0):
        states.pop("torch.cuda", None)  # saved with other CUDA devices: keep the torch.manual_seed ones
    return states


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not _is_int(seed) or not 0 <= operator.index(seed) <= MAX_SEED:
        raise ValueError(
            f"`seed` should be an integer in [0, {MAX_SEED}] (the range NumPy's generator accepts), got {seed!r}."
        )
    return operator.index(seed)


def _check_rank(rank: Any) -> int:
    if isinstance(rank, bool) or not _is_int(rank) or operator.index(rank) < 0:
        raise ValueError(f"`rank` should be a non-negative integer or None, got {rank!r}.")
    return operator.index(rank)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` should be one of True, False, got {value!r}.")
    return value


def _is_int(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True
