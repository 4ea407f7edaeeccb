"""Rank-aware seeding callback; rationale in docs/design.md ("Seeding per rank")."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader
from typing_extensions import override

from ddp_plugins.core.checkpoints import PER_RANK, gather_per_rank
from ddp_plugins.core.checks import check_bool
from ddp_plugins.core.ranks import get_world_size
from ddp_plugins.core.seeding import (
    check_seed,
    collect_rng_states,
    decode_rng_states,
    encode_rng_states,
    rank_seed,
    seed_process,
    set_deterministic,
    set_rng_states,
)
from ddp_plugins.lightning.contracts import GathersPerRankState, implements

__all__ = ["RankAwareSeed"]


class RankAwareSeed(Callback):
    """Identical model initialization on every rank, then a distinct random stream per rank.

    A resume restores each rank's streams; on another world size it warns and seeds ``(seed, rank, global_step)``.
    The arguments are :func:`seed_everything_rank_aware`'s; ``deterministic`` applies in ``setup``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[RankAwareSeed(seed=42)], logger=False)
    """

    def __init__(self, seed: int, workers: bool = True, deterministic: bool = False) -> None:
        self.seed = check_seed(seed)
        self.workers = check_bool("workers", workers)
        self.deterministic = check_bool("deterministic", deterministic)
        self._trainer: Trainer | None = None
        self._started = False
        self._resume_step: int | None = None
        self._loaded: dict[str, Any] | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer, self._started = trainer, False
        if self.deterministic:
            set_deterministic()
        seed_process(self.seed, self.seed, self.workers)  # identical on every rank until fit starts

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._resume_step = int(checkpoint.get("global_step", 0))

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started = True
        self._start_streams(trainer)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning issue 21938 (2.5.3+): a resumed epoch's iterator, made before set_epoch, draws epoch 0's order
        if not self._resume_step:
            return
        loaders: list[DataLoader] = []
        apply_to_collection(trainer.train_dataloader, DataLoader, loaders.append)
        if any(_stale_shuffle(loader, trainer) for loader in loaders):
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

    on_predict_start = on_test_start

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer, self._started, self._resume_step, self._loaded = None, False, None, None

    @override
    def state_dict(self) -> dict[str, Any]:
        # no collective: PER_RANK is gathered when the checkpoint is saved, with every rank in step
        states = encode_rng_states(collect_rng_states(include_cuda=True))
        return {"seed": self.seed, "world_size": get_world_size(), PER_RANK: states}

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # under a strategy that does not gather per-rank parts when it saves (every rank dumps, in step)
        if not implements(trainer.strategy, GathersPerRankState):
            gather_per_rank(checkpoint)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)
        if self._started and self._trainer is not None:  # strategies that restore after setup (FSDP, DeepSpeed)
            self._start_streams(self._trainer)

    def _start_streams(self, trainer: Trainer) -> None:
        loaded, self._loaded = self._loaded, None
        rank, world_size, step = trainer.global_rank, trainer.world_size, self._resume_step or 0
        if loaded is None:
            problem = f"no `{type(self).__name__}` random states" if step > 0 else ""
        elif len(states := _rank_states(loaded)) != world_size:
            problem = f"random states for {len(states)} ranks, this run has {world_size}"
        else:
            if loaded.get("seed", self.seed) != self.seed:
                rank_zero_warn(
                    f"Resuming the random streams of seed {loaded.get('seed')} from the checkpoint;"
                    f" `seed`={self.seed} applies to fresh runs only."
                )
            set_rng_states(decode_rng_states(states[rank]))
            return
        if problem:
            rank_zero_warn(
                f"The checkpoint holds {problem}; starting fresh per-rank streams (seed {self.seed}, step {step}),"
                " not an exact continuation."
            )
        self._seed_rank(rank, step)

    def _seed_rank(self, rank: int, step: int) -> None:
        key = (rank,) if step == 0 else (rank, step)
        seed_process(self.seed, rank_seed(self.seed, *key), self.workers)


def _rank_states(loaded: dict[str, Any]) -> list[Any]:
    """Every rank's states from a checkpoint: gathered by the strategy, or one rank's (not gathered)."""
    # "rng_states": checkpoints that keep the states without a per-rank slot
    states = loaded.get(PER_RANK, loaded.get("rng_states"))
    if isinstance(states, dict):  # saved by a strategy that does not gather: one rank's states only
        return [states] if loaded.get("world_size") == 1 else []
    return list(states or [])


def _stale_shuffle(dataloader: DataLoader, trainer: Trainer) -> bool:
    sampler = getattr(dataloader.batch_sampler, "sampler", dataloader.sampler)
    return (
        dataloader.num_workers > 0
        and getattr(sampler, "shuffle", False)
        and getattr(sampler, "epoch", trainer.current_epoch) != trainer.current_epoch
    )
