"""Contracts between the Lightning adapters, checked with ``isinstance``, as torch's ``Joinable``.

Rationale in docs/design.md ("Contracts between the adapters")."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeGuard, TypeVar, runtime_checkable

__all__ = [
    "AccumulationSchedule",
    "CarriesSpawnResults",
    "GathersPerRankState",
    "OwnsAccumulationWindow",
    "SavesCheckpoints",
    "ShardsEachStep",
    "StepAgreement",
    "implements",
    "virtual_shards",
    "of_kind",
]


_T = TypeVar("_T")


@runtime_checkable
class StepAgreement(Protocol):
    """A strategy whose training steps already make one collective round that can carry flags.

    A callback that must agree on a flag at step boundaries (a stop signal) registers a source
    (a callable giving this rank's flag, 0 to 64) and reads :meth:`agreed_flag` at the boundary:
    the largest flag any rank raised, or ``None`` when this run's steps make no such round (the
    callback then makes its own ``all_reduce``).
    """

    def add_flag_source(self, source: Callable[[], int]) -> None: ...

    def remove_flag_source(self, source: Callable[[], int]) -> None: ...

    def agreed_flag(self) -> int | None: ...


@runtime_checkable
class GathersPerRankState(Protocol):
    """A strategy that gathers every callback's per-rank state part when a checkpoint is saved.

    Callbacks put this rank's part under :data:`ddp_plugins.core.checkpoints.PER_RANK` of their ``state_dict``;
    the strategy replaces it with every rank's in ``save_checkpoint``, the one point every rank reaches in
    step. Under any other strategy the callback gathers in ``on_save_checkpoint`` itself.
    """

    def gather_per_rank_state(self, checkpoint: dict[str, Any]) -> None: ...


@runtime_checkable
class SavesCheckpoints(Protocol):
    """A strategy that records the path of every checkpoint its ``save_checkpoint`` wrote, in order."""

    checkpoint_paths: list[str]


@runtime_checkable
class ShardsEachStep(Protocol):
    """A strategy that may run each step as virtual shards of fixed rows (the reproducible mode).

    ``virtual_shards`` is their number while the mode is on, ``None`` otherwise. BatchNorm then
    normalizes per shard, and evaluation batches are aligned to the same rows on any world size.
    """

    @property
    def virtual_shards(self) -> int | None: ...


def virtual_shards(strategy: Any) -> int | None:
    """The strategy's virtual shards per step when it runs the reproducible mode, else ``None``.

    Example::

        >>> virtual_shards(object()) is None
        True
    """
    return strategy.virtual_shards if implements(strategy, ShardsEachStep) else None


@runtime_checkable
class AccumulationSchedule(Protocol):
    """A callback that sets ``trainer.accumulate_grad_batches`` per epoch from ``{epoch: K}``.

    Lightning's ``GradientAccumulationScheduler`` has this shape already.
    """

    scheduling: Mapping[int, int]


@runtime_checkable
class OwnsAccumulationWindow(Protocol):
    """A callback that runs accumulation windows itself (manual optimization).

    ``manual_window`` is its K while it does, ``None`` while Lightning's loop accumulates.
    """

    @property
    def manual_window(self) -> int | None: ...


@runtime_checkable
class CarriesSpawnResults(Protocol):
    """A callback whose results, made in spawned ranks, travel back to the launching process.

    In spawned rank 0, ``export_results`` writes them to a file and returns its path (the path
    travels, not the bytes); in the launching process, the callback with the same
    ``spawn_results_key`` (its copy) reads and removes that file in ``import_results``.
    """

    spawn_results_key: str

    def export_results(self) -> str: ...

    def import_results(self, path: str) -> None: ...


def implements(obj: Any, kind: type[_T]) -> TypeGuard[_T]:
    """``isinstance(obj, kind)`` for one of these protocols, decided once per class (its first instance's
    answer is kept: why, docs/design.md, "Contracts between the adapters").

    Example::

        >>> from lightning.pytorch.callbacks import GradientAccumulationScheduler
        >>> implements(GradientAccumulationScheduler({0: 2}), AccumulationSchedule), implements(object(), StepAgreement)
        (True, False)
    """
    key = (type(obj), kind)
    known = _IMPLEMENTS.get(key)
    if known is None:
        known = _IMPLEMENTS[key] = isinstance(obj, kind)
    return known


_IMPLEMENTS: dict[tuple[type[Any], type[Any]], bool] = {}


def of_kind(objects: Iterable[Any], kind: type[_T]) -> list[_T]:
    """The objects (callbacks, usually) that implement protocol ``kind``, in order (:func:`implements`).

    Example::

        >>> from lightning.pytorch.callbacks import GradientAccumulationScheduler
        >>> [type(c).__name__ for c in of_kind([GradientAccumulationScheduler({0: 2}), object()], AccumulationSchedule)]
        ['GradientAccumulationScheduler']
    """
    return [obj for obj in objects if implements(obj, kind)]
