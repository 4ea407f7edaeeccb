"""The sums of ``self.log(..., on_epoch=True)`` across a mid-epoch resume (Lightning keeps them in memory only).

``resumed + saved`` has the bits of ``saved + resumed`` (float addition commutes); torchmetrics use ``merge_state``."""

from __future__ import annotations

import logging
from typing import Any

from torchmetrics import Metric

from ddp_plugins import _compat
from ddp_plugins.core.trees import tree_map
from ddp_plugins.lightning.contracts import virtual_shards

__all__ = ["EpochPartials"]

log = logging.getLogger(__name__)


class EpochPartials:
    """Save and restore the running sums of the training epoch's ``on_epoch`` values, per rank.

    On another number of ranks a ``sync_dist`` value's sums all go to rank 0; an unsynced one, or a copy the
    reproducible mode logs in ``training_step``, continues on every rank from old rank 0's.

    Example (two ranks resumed on three)::

        >>> import torch
        >>> def entry(rank, synced, copies=False):
        ...     return {"value": torch.tensor(rank + 1.0), "count": None, "synced": synced, "copies": copies}
        >>> kinds = {"summed": (True, False), "own": (False, False), "copy": (True, True)}
        >>> parts = [{"epoch": 0, "entries": {k: entry(r, *v) for k, v in kinds.items()}} for r in range(2)]
        >>> class Rank:
        ...     current_epoch, world_size = 0, 3
        ...     def __init__(self, rank): self.global_rank = rank
        >>> for rank in range(3):
        ...     partials = EpochPartials()
        ...     partials.load(parts, Rank(rank))
        ...     print(rank, {k: [float(e["value"]) for e in v] for k, v in sorted(partials._pending.items())})
        0 {'copy': [1.0], 'own': [1.0], 'summed': [1.0, 2.0]}
        1 {'copy': [1.0], 'own': [1.0]}
        2 {'copy': [1.0], 'own': [1.0]}
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] = {}
        self._epoch: int | None = None

    @staticmethod
    def save(trainer: Any) -> dict[str, Any]:
        """This rank's partial sums of the current training epoch (no collective)."""
        entries: dict[str, Any] = {}
        for key, entry in _compat.training_epoch_results(trainer).items():
            meta = getattr(entry, "meta", None)
            if meta is None or not meta.on_epoch:
                continue
            if entry.is_tensor and (meta.is_mean_reduction or meta.is_sum_reduction):
                count = entry.cumulated_batch_size.detach().clone() if meta.is_mean_reduction else None
                synced = bool(meta.sync.should)  # sync_dist: summed over the ranks at the epoch's end
                copies = meta.fx.split(".")[0] == "training_step" and virtual_shards(trainer.strategy) is not None
                value = entry.value.detach().clone()
                entries[key] = {"value": value, "count": count, "synced": synced, "copies": copies}
            elif not entry.is_tensor and isinstance(entry.value, Metric) and meta.metric_attribute:
                states = tree_map(lambda t: t.detach().clone(), entry.value.metric_state)
                entries[key] = {"attribute": meta.metric_attribute, "states": states}
            else:  # a max or min: no sum to carry
                entries[key] = {"skipped": str(getattr(meta.reduce_fx, "__name__", meta.reduce_fx))}
        return {"epoch": trainer.current_epoch, "entries": entries}

    def load(self, parts: list[Any], trainer: Any) -> None:
        """Take the checkpoint's parts (one per rank that wrote it) for the resumed epoch."""
        rank, world = trainer.global_rank, trainer.world_size
        parts = [p for p in parts if isinstance(p, dict) and isinstance(p.get("entries"), dict)]
        if not parts:
            return
        self._epoch = int(parts[0].get("epoch", -1))
        self._pending = {}
        for old_rank, part in enumerate(parts):
            for key, entry in part["entries"].items():
                if len(parts) == world:
                    take = old_rank == rank  # the same ranks: each its own sums
                elif entry.get("synced", True) and not entry.get("copies", False):
                    take = rank == 0  # summed over the ranks: rank 0 carries every old rank's
                else:  # each rank's own value (rank 0's is the one logged), or a copy of the same: rank 0's
                    take = old_rank == 0
                if take:
                    self._pending.setdefault(key, []).append(entry)
        skipped = sorted({k for k, entries in self._pending.items() for e in entries if "skipped" in e})
        for key in skipped:
            del self._pending[key]
        if skipped and rank == 0:
            log.warning(
                "resume: the interrupted epoch's maximum or minimum of %s covers only the steps after the resume"
                " (Lightning keeps no sum for it to carry over).",
                ", ".join(skipped),
            )

    def before_batch(self, trainer: Any, pl_module: Any) -> None:
        """Merge torchmetrics states before their first update of the resumed epoch."""
        if not self._current(trainer):
            return
        for key, entries in list(self._pending.items()):
            if all("attribute" in e for e in entries):
                metric = pl_module.get_submodule(entries[0]["attribute"])
                for entry in entries:
                    metric.merge_state(entry["states"])
                del self._pending[key]

    def after_batch(self, trainer: Any) -> None:
        """Add the saved sums to the values the resumed epoch has logged by now."""
        if not self._current(trainer):
            return
        results = _compat.training_epoch_results(trainer)
        for key, entries in list(self._pending.items()):
            if key not in results or any("value" not in e for e in entries):
                continue
            for entry in entries:
                _compat.add_to_epoch_sum(results[key], entry["value"], entry["count"])
            del self._pending[key]

    def _current(self, trainer: Any) -> bool:
        """Whether the saved sums belong to the running epoch; forgotten once it is another."""
        if self._pending and self._epoch != trainer.current_epoch:
            self._pending = {}
        return bool(self._pending)
