"""Sequential distributed evaluation: every sample once, in dataset order, exact metrics."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from torchmetrics import Metric
from typing_extensions import override

from ddp_plugins import _compat
from ddp_plugins.core.checks import ArgumentTypeError, ArgumentValueError, check_choice, check_number
from ddp_plugins.core.collectives import concat_batches, distributed_concat, num_rows, truncate_rows
from ddp_plugins.core.files import save_atomic
from ddp_plugins.core.samplers import SequentialDistributedSampler
from ddp_plugins.lightning.contracts import virtual_shards
from ddp_plugins.lightning.steps import padding_apart_loader

__all__ = ["SequentialEvaluation"]

_STAGES = ("validate", "test", "predict")
_PREFIX = {"validate": "val", "test": "test", "predict": "predict"}
_STEP = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}
_EVALUATED_IN = {"fit": "validate", "validate": "validate", "test": "test", "predict": "predict"}


def _stage_hooks(stage: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """``stage``'s batch-end hook (collects the step's outputs) and epoch-end hook (gathers them)."""

    def batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, stage, outputs, dataloader_idx)

    def epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer, pl_module, stage)

    return batch_end, epoch_end


class SequentialEvaluation(Callback):
    """Exact, ordered validation, test and predict results and metrics under DDP.

    Gathers the step outputs (one row per sample) of ``stages`` on rank 0, in dataset order, into ``results[stage]``
    or ``paths[stage]``, metrics into ``metric_values[stage]`` (docs/design.md, "Exact distributed evaluation").

    Args:
        metrics: torchmetrics metrics by name, computed on the gathered ``preds_key``/``target_key`` outputs and
            logged as ``val/<name>``, ``test/<name>`` (cloned, never updated).
        preds_key, target_key: the keys of the predictions and the targets in the step output dict.
        stages: which of ``'validate'``, ``'test'``, ``'predict'`` to handle.
        output_dir: write each stage's results there on rank 0 instead of keeping them in memory.
        pad_value: pads outputs whose trailing dimensions vary (``None``: such outputs are an error).

    Example::

        >>> from torchmetrics.classification import MulticlassAccuracy
        >>> callback = SequentialEvaluation(metrics={"acc": MulticlassAccuracy(num_classes=10)})
        >>> # trainer = Trainer(strategy="ddp", devices=2, callbacks=[callback])
        >>> # trainer.validate(model, dataloader); callback.results["validate"]["preds"]
    """

    def __init__(
        self,
        metrics: Mapping[str, Metric] | None = None,
        preds_key: str = "preds",
        target_key: str = "target",
        stages: Sequence[str] = _STAGES,
        output_dir: str | os.PathLike | None = None,
        pad_value: float | None = None,
    ) -> None:
        metrics = dict(metrics.items()) if metrics is not None and hasattr(metrics, "items") else metrics
        if metrics is not None and not isinstance(metrics, dict):
            raise ArgumentTypeError("metrics", "a mapping of names to torchmetrics Metrics", metrics)
        for name, metric in (metrics or {}).items():
            if not isinstance(name, str) or not isinstance(metric, Metric):
                allowed = "a mapping of names (str) to torchmetrics.Metric instances"
                raise ArgumentTypeError("metrics", allowed, problem=f"got {name!r}: {type(metric).__name__}")
        for arg, value in (("preds_key", preds_key), ("target_key", target_key)):
            if not isinstance(value, str):
                raise ArgumentTypeError(arg, "a str", value)
        if isinstance(stages, str) or not isinstance(stages, Sequence) or not stages:
            raise ArgumentValueError("stages", "a non-empty list of 'validate', 'test', 'predict'", stages)
        for stage in stages:
            check_choice("stages", stage, _STAGES)
        if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):
            raise ArgumentTypeError("output_dir", "a path or None", output_dir)
        check_number("pad_value", pad_value, allow_none=True)
        self.metrics = metrics or {}
        self.preds_key = preds_key
        self.target_key = target_key
        self.stages = tuple(stages)
        self.output_dir = None if output_dir is None else str(output_dir)
        self.pad_value = pad_value
        self.results: dict[str, Any] = {}
        self.paths: dict[str, str] = {}
        self.metric_values: dict[str, Any] = {}
        self.spawn_results_key = uuid.uuid4().hex  # pairs this callback with its copy in spawned workers
        self._samplers: dict[str, list[tuple[SequentialDistributedSampler, int]]] = {}
        self._buffers: dict[int, list[Any]] = defaultdict(list)
        self._sources: list[Any] = []

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        name = _EVALUATED_IN.get(stage)  # a plain str: `stage` may be a TrainerFn
        if name in self.stages:
            loop = trainer.fit_loop.epoch_loop.val_loop if stage == "fit" else getattr(trainer, f"{name}_loop")
            self._wrap_source(trainer, name, _compat.loop_data_source(loop))
        if self.output_dir is not None and trainer.is_global_zero:
            Path(self.output_dir).mkdir(parents=True, exist_ok=True)

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._buffers.clear()

    on_test_epoch_start = on_predict_epoch_start = on_validation_epoch_start
    on_validation_batch_end, on_validation_epoch_end = _stage_hooks("validate")
    on_test_batch_end, on_test_epoch_end = _stage_hooks("test")
    on_predict_batch_end, on_predict_epoch_end = _stage_hooks("predict")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for source in self._sources:
            vars(source).pop("dataloader", None)  # back to the class method
        self._sources = []
        self._buffers.clear()

    def _wrap_source(self, trainer: Trainer, stage: str, source: Any) -> None:
        """Swap samplers where Lightning requests the dataloaders, before it injects its own."""
        if "dataloader" in vars(source):
            return
        original = source.dataloader
        source.dataloader = lambda: self._sequential_loaders(trainer, stage, original())
        self._sources.append(source)

    def _sequential_loaders(self, trainer: Trainer, stage: str, dataloaders: Any) -> CombinedLoader:
        combined = dataloaders if isinstance(dataloaders, CombinedLoader) else CombinedLoader(dataloaders, "sequential")
        mode = _compat.combined_loader_mode(combined)
        if mode != "sequential":
            needs = "SequentialEvaluation needs `CombinedLoader(mode='sequential')`"
            raise ValueError(f"{needs} for {stage}, got mode {mode!r}.")
        hook = f"{_PREFIX[stage]}_dataloader"
        swapped, self._samplers[stage] = [], []
        for dl in combined.flattened:
            # the reproducible mode: batches of the same rows on any number of ranks
            align = dl.batch_size if virtual_shards(trainer.strategy) is not None and dl.batch_size else 1
            sampler = SequentialDistributedSampler(
                _check_replaceable(dl, hook), num_replicas=trainer.world_size, rank=trainer.global_rank, align=align
            )
            # where possible, padding rows in batches of their own, which DDPPluginsStrategy counts for nothing
            apart_wanted = trainer.world_size > 1 and stage != "predict"
            apart = padding_apart_loader(dl, trainer.world_size, trainer.global_rank) if apart_wanted else None
            self._samplers[stage].append((sampler if apart is None else apart.sampler, dl.batch_size))
            swapped.append(_compat.update_dataloader(dl, sampler) if apart is None else apart)
        combined.flattened = swapped
        return combined

    def _collect(self, trainer: Trainer, stage: str, outputs: Any, dataloader_idx: int) -> None:
        if trainer.sanity_checking or stage not in self._samplers:
            return
        self._buffers[dataloader_idx].append(apply_to_collection(outputs, Tensor, lambda t: t.detach().cpu()))

    def _finish(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.sanity_checking or stage not in self._samplers:
            self._buffers.clear()
            return
        gathered_all, values = [], {}
        several = len(self._samplers[stage]) > 1
        for idx, (sampler, batch_size) in enumerate(self._samplers[stage]):
            local, error = None, None
            try:
                local = self._rank_rows(stage, self._buffers.pop(idx, []), sampler, batch_size)
            except (TypeError, ValueError, RuntimeError) as exc:  # raised on every rank by the gather below
                error = str(exc)
            gathered = distributed_concat(local, sampler.dataset_length, pad_value=self.pad_value, local_error=error)
            gathered_all.append(gathered)
            if self.metrics and stage != "predict":
                suffix = f"/dataloader_idx_{idx}" if several else ""
                values.update(self._log_metrics(pl_module, stage, gathered, suffix))
        self._buffers.clear()
        if values:
            self.metric_values[stage] = values
        if not trainer.is_global_zero:
            return
        result = gathered_all if several else gathered_all[0]
        if self.output_dir is None:
            self.results[stage] = result
            return
        self.paths[stage] = str(save_atomic(result, Path(self.output_dir) / f"{stage}.pt"))
        self.results.pop(stage, None)

    def _rank_rows(self, stage: str, batches: list[Any], sampler: Any, batch_size: int) -> Any:
        """This rank's outputs, concatenated over batches, without the sampler's padding."""
        if all(out is None for out in batches):
            return None
        local = concat_batches(batches, self.pad_value, _STEP[stage])
        rows = num_rows(local, _STEP[stage])
        expected = min(sampler.num_samples, len(batches) * batch_size)  # the rows it yields
        if rows != expected:
            raise ValueError(
                f"`{_STEP[stage]}` returned {rows} rows for the {expected} samples of this rank; SequentialEvaluation"
                " needs one row per sample (dim 0 is the batch), e.g. `{'preds': logits, 'target': y}`."
            )
        if expected < sampler.num_samples:
            rank_zero_warn(
                f"SequentialEvaluation: `limit_{_PREFIX[stage]}_batches` evaluates {expected} of {sampler.num_samples}"
                " samples per rank, so the gathered results are a subset of the dataset and not in dataset order."
            )
        return truncate_rows(local, min(rows, sampler.num_real_samples))

    def _log_metrics(self, pl_module: LightningModule, stage: str, gathered: Any, suffix: str) -> dict[str, Any]:
        if not isinstance(gathered, Mapping) or self.preds_key not in gathered or self.target_key not in gathered:
            found = sorted(gathered) if isinstance(gathered, Mapping) else type(gathered).__name__
            raise ValueError(
                f"`metrics` need `{_STEP[stage]}` to return a dict with keys {self.preds_key!r} and"
                f" {self.target_key!r} (see `preds_key` / `target_key`), got {found}."
            )
        values = {}
        for name, metric in self.metrics.items():
            local = metric.clone()
            local.reset()
            local.distributed_available_fn = lambda: False  # the data is already global
            local.update(gathered[self.preds_key], gathered[self.target_key])
            key = f"{_PREFIX[stage]}/{name}{suffix}"
            values[key] = value = local.compute()
            if isinstance(value, Tensor) and value.numel() == 1:
                # the same on every rank: "max" keeps it bit-exact; on the module's device (nccl reduces CUDA only)
                value = value.float().to(pl_module.device)
                pl_module.log(key, value, sync_dist=True, reduce_fx="max", add_dataloader_idx=False)
        return values

    def __getstate__(self) -> dict[str, Any]:
        # copies sent to spawned workers start empty: results only ever travel back, never out
        empty: dict[str, Any] = {"results": {}, "paths": {}, "metric_values": {}, "_samplers": {}, "_sources": []}
        return {**self.__dict__, **empty, "_buffers": defaultdict(list)}

    def export_results(self) -> str:
        """Write this rank's results to a temporary file whose path travels back (a large payload would block)."""
        fd, path = tempfile.mkstemp(prefix="ddp_plugins_eval_", suffix=".pt")
        with os.fdopen(fd, "wb") as file:
            torch.save({"results": self.results, "paths": self.paths, "metric_values": self.metric_values}, file)
        return path

    def import_results(self, path: str) -> None:
        """Take the results a spawned rank 0 exported to ``path`` (and remove the file)."""
        try:
            state = torch.load(path, weights_only=True)
        finally:
            os.remove(path)
        self.results.update(state["results"])
        self.paths.update(state["paths"])
        self.metric_values.update(state["metric_values"])


def _check_replaceable(dl: Any, hook: str) -> Dataset:
    """The dataset of ``dl`` if its sampler can be swapped without changing which samples are seen."""
    if not isinstance(dl, DataLoader):
        raise TypeError(f"SequentialEvaluation needs `{hook}` to return torch DataLoaders, got {type(dl).__name__}.")
    dataset = dl.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"SequentialEvaluation cannot shard the {type(dataset).__name__} of `{hook}`: an IterableDataset has no"
            " length to split into contiguous slices. Use a map-style dataset (`__len__` and `__getitem__`), or"
            " shard the stream per rank yourself, gather with `ddp_plugins.distributed_concat` and leave this"
            " stage out of `stages`."
        )
    if dl.batch_sampler is None or type(dl.batch_sampler) is not BatchSampler:
        got = "batch_size=None" if dl.batch_sampler is None else type(dl.batch_sampler).__name__
        raise TypeError(f"SequentialEvaluation needs `{hook}` to batch with `batch_size=...`, got {got}.")
    if dl.batch_size is None:  # DataLoader(batch_sampler=BatchSampler(...)): Lightning cannot rebuild it
        raise TypeError(
            f"SequentialEvaluation needs `{hook}` to batch with `batch_size=...`, got"
            f" `batch_sampler={type(dl.batch_sampler).__name__}(...)`. Pass `batch_size=` and `shuffle=`"
            " (or `sampler=`) instead, or leave this stage out of `stages`."
        )
    if dl.drop_last:
        raise ValueError(f"`{hook}` has `drop_last=True`, which skips samples; SequentialEvaluation needs every one.")
    if type(dl.sampler) not in (SequentialSampler, RandomSampler, DistributedSampler, SequentialDistributedSampler):
        raise TypeError(
            f"`{hook}` uses the custom sampler {type(dl.sampler).__name__}, which SequentialEvaluation cannot replace"
            " without changing which samples are evaluated. Allowed: no sampler, SequentialSampler, RandomSampler,"
            " DistributedSampler. Drop the sampler, or leave this stage out of `stages`."
        )
    return dataset
