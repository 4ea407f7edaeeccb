"""Contracts between the adapters, checked with ``isinstance``; see docs/design.md, "Contracts between the adapters"."""

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
    """A strategy whose training steps make a collective round carrying each source's flag (0 to 64).

    :meth:`agreed_flag`: the largest flag any rank raised, ``None`` where no such round runs (make your own)."""

    def add_flag_source(self, source: Callable[[], int]) -> None: ...

    def remove_flag_source(self, source: Callable[[], int]) -> None: ...

    def agreed_flag(self) -> int | None: ...


@runtime_checkable
class GathersPerRankState(Protocol):
    """A strategy that gathers the callbacks' ``PER_RANK`` state parts in ``save_checkpoint`` (else they do)."""

    def gather_per_rank_state(self, checkpoint: dict[str, Any]) -> None: ...


@runtime_checkable
class SavesCheckpoints(Protocol):
    """A strategy that records the path of every checkpoint its ``save_checkpoint`` wrote, in order."""

    checkpoint_paths: list[str]


@runtime_checkable
class ShardsEachStep(Protocol):
    """A strategy whose ``virtual_shards`` is the reproducible mode's shards per step, ``None`` while it is off."""

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
    """A callback setting ``accumulate_grad_batches`` per epoch from ``{epoch: K}`` (as Lightning's scheduler)."""

    scheduling: Mapping[int, int]


@runtime_checkable
class OwnsAccumulationWindow(Protocol):
    """A callback running accumulation windows itself: ``manual_window`` is K, ``None`` while Lightning's loop does."""

    @property
    def manual_window(self) -> int | None: ...


@runtime_checkable
class CarriesSpawnResults(Protocol):
    """A callback whose results travel from spawned rank 0 (``export_results``: a file's path) to its copy with
    the same ``spawn_results_key`` in the launching process (``import_results`` reads and removes the file)."""

    spawn_results_key: str

    def export_results(self) -> str: ...

    def import_results(self, path: str) -> None: ...


def implements(obj: Any, kind: type[_T]) -> TypeGuard[_T]:
    """``isinstance(obj, kind)`` for one of these protocols, decided once per class (see the module's section).

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
