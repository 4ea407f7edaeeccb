r"""Sequential distributed evaluation.

Exact validation, test and predict results under DDP: every sample evaluated once, in dataset
order, metrics computed on exactly the dataset.

Why this exists
---------------
``DistributedSampler`` interleaves samples over ranks (rank ``r`` gets ``r, r + N, ...``) and pads
the last shard with samples from the *start* of the dataset, so that every rank runs the same
number of steps. Metrics reduced over ranks then count those duplicates: on a dataset whose length
is not a multiple of the world size they are biased (pytorch issue 25162, Lightning issue 7929,
the torchmetrics docs on uneven inputs). For ``trainer.predict`` Lightning uses an *unpadded*
sampler, so ranks may run different numbers of steps, never gathers across ranks, and under
``ddp_spawn`` / ``ddp_notebook`` cannot return predictions at all.

The classic remedy (Hugging Face's ``SequentialDistributedSampler`` + ``distributed_concat``),
built as a Lightning feature:

* :class:`SequentialDistributedSampler` gives rank ``r`` one contiguous slice of the dataset, and
  every rank the same number of samples; only the last shard(s) are padded, by repeating the last
  index, so after concatenation in rank order all padding sits at the end.
* :func:`distributed_concat` all-gathers every rank's results (a tensor or nested dict/list/tuple
  of tensors, plus lists of Python objects such as ids), concatenates them along dim 0 in rank
  order and truncates to the true length. Ranks may hold different numbers of rows: like
  torchmetrics' ``gather_all_tensors`` it exchanges shapes first, pads, gathers, trims; like
  accelerate it checks structures and dtypes on every rank before any tensor collective and
  raises one error listing every rank's shapes on *every* rank, instead of hanging.
* :class:`SequentialEvaluation` is the Lightning adapter: it puts the sampler into the
  validation, test and predict dataloaders, collects what the step methods return, gathers it at
  epoch end, computes the torchmetrics metrics it is given on exactly the dataset's samples and
  logs them, and hands the results to the caller (rank 0 under ``ddp``, the calling process under
  ``ddp_spawn`` / ``ddp_notebook``).

What is reused: ``DistributedSampler`` (ours subclasses it, so Lightning leaves it in place and
still wraps it for predict-time index tracking), Lightning's ``_update_dataloader`` to rebuild
user DataLoaders with a new sampler, ``all_gather_object`` / ``all_gather_single`` for the
collectives, ``Metric.clone`` for the metrics, ``self.log`` for logging, and the multiprocessing
launcher's ``get_extra_results`` / ``update_main_process_results`` pair, the channel on which
Lightning itself sends ``callback_metrics`` from rank 0 to the calling process. Two hooks are
added by hand because Lightning has none: the sampler must be swapped where the dataloader is
requested (Lightning replaces every non-``DistributedSampler`` before any callback hook runs), and
a callback cannot replace the launcher before it starts, so this module wraps those two launcher
methods once, chaining to the originals.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from torchmetrics import Metric
from typing_extensions import override

from ddp_plugins.distributed import save_atomic

__all__ = ["SequentialDistributedSampler", "SequentialEvaluation", "distributed_concat"]

_STAGES = ("validate", "test", "predict")
_PREFIX = {"validate": "val", "test": "test", "predict": "predict"}
_STEP = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}
_EXTRA_KEY = "ddp_plugins.sequential_evaluation"


class SequentialDistributedSampler(DistributedSampler):
    """Contiguous, equal-length shards: rank ``r`` gets ``dataset[r * n : (r + 1) * n]`` in order.

    ``n = ceil(len(dataset) / num_replicas)``. Shards past the end of the dataset are padded by
    repeating the last index, so every rank runs the same number of steps and collectives line
    up; concatenating the shards in rank order and keeping the first ``len(dataset)`` entries
    gives the dataset exactly, in order. ``num_real_samples`` says how many of this rank's
    samples are real (the rest are padding, at the end of the shard).

    Args:
        dataset: a map-style dataset (with ``__len__``).
        num_replicas: number of ranks; the world size of the default process group when ``None``.
        rank: this rank; the rank in the default process group when ``None``.

    Raises:
        TypeError: ``dataset`` is an ``IterableDataset`` or has no length.

    Example::

        >>> [list(SequentialDistributedSampler(range(5), num_replicas=2, rank=r)) for r in (0, 1)]
        [[0, 1, 2], [3, 4, 4]]
        >>> SequentialDistributedSampler(range(5), num_replicas=2, rank=1).num_real_samples
        2
    """

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"`dataset` should be a map-style dataset with a length, got {type(dataset).__name__}."
                " An IterableDataset cannot be split into contiguous shards: shard it per rank yourself"
                " and gather the results with `distributed_concat`."
            )
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.dataset_length = len(dataset)
        self.num_samples = math.ceil(self.dataset_length / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.num_real_samples = max(0, min(self.num_samples, self.dataset_length - self.rank * self.num_samples))

    @override
    def __iter__(self):
        start = self.rank * self.num_samples
        padding = [self.dataset_length - 1] * (self.num_samples - self.num_real_samples)
        return iter(list(range(start, start + self.num_real_samples)) + padding)

    @override
    def __len__(self) -> int:
        return self.num_samples


def distributed_concat(
    data: Any, num_total_examples: int | None = None, *, pad_value: float | None = None, group: Any = None
) -> Any:
    """All-gather ``data`` from every rank, concatenate along dim 0 in rank order, truncate.

    ``data`` is a tensor, a list of Python objects (ids, strings: one entry per row), or a nested
    dict / tuple / list of those (lists holding only tensors or containers are structure). Ranks
    may hold different numbers of rows, including none. Every rank gets the full result, with
    tensors on the device they came from. Works without a process group (world size 1).

    Args:
        data: this rank's rows.
        num_total_examples: keep only the first this many rows of the result (drops the padding of
            :class:`SequentialDistributedSampler`); ``None`` keeps everything.
        pad_value: when given, tensors whose trailing dimensions differ across ranks (variable
            length sequences) are padded to the largest with this value; when ``None`` they raise.
        group: the process group; the default group when ``None``.

    Raises:
        ValueError: structures, dtypes or trailing shapes differ across ranks (the message lists
            every rank's shapes and is raised on every rank), or an argument is invalid.
        TypeError: ``data`` holds something that is neither a tensor, a container nor a list of rows.

    Example::

        >>> distributed_concat({"preds": torch.arange(4), "ids": ["a", "b", "c", "d"]}, 3)
        {'preds': tensor([0, 1, 2]), 'ids': ['a', 'b', 'c']}
    """
    return _concat(data, num_total_examples, pad_value=pad_value, group=group)


class SequentialEvaluation(Callback):
    """Exact, ordered validation, test and predict results and metrics under DDP.

    Puts a :class:`SequentialDistributedSampler` into the dataloaders of ``stages``, collects what
    ``validation_step`` / ``test_step`` / ``predict_step`` return (moved to CPU per batch),
    gathers it at epoch end with :func:`distributed_concat` and drops the padding, so the results
    are exactly the dataset's samples in dataset order. Step outputs must have one row per sample
    (dim 0 is the batch): a tensor, a dict / tuple of tensors, lists of ids.

    After ``trainer.validate/test/predict`` (and after each validation during ``fit``) the
    results are in ``results["validate" | "test" | "predict"]`` (a list per dataloader when there
    are several), or written to ``output_dir/<stage>.pt`` with the path in ``paths[stage]``; the
    computed metrics are in ``metric_values[stage]``. They are kept on global rank 0 under
    ``ddp`` and sent to the calling process under ``ddp_spawn`` / ``ddp_notebook``.

    Args:
        metrics: torchmetrics metrics by name, computed on the gathered ``preds_key`` and
            ``target_key`` entries of the step outputs and logged as ``val/<name>`` and
            ``test/<name>``. The objects given are cloned, never updated.
        preds_key: key of the predictions in the step output dict.
        target_key: key of the targets in the step output dict.
        stages: which of ``'validate'``, ``'test'``, ``'predict'`` to handle.
        output_dir: write each stage's results there (temporary name, then rename) on rank 0
            instead of keeping them in memory.
        pad_value: pad value for outputs whose trailing dimensions vary between batches or ranks
            (variable length sequences); ``None`` makes such outputs an error.

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
            raise TypeError(f"`metrics` should be a mapping of names to torchmetrics Metrics, got {metrics!r}.")
        for name, metric in (metrics or {}).items():
            if not isinstance(name, str) or not isinstance(metric, Metric):
                raise TypeError(
                    "`metrics` should map names (str) to torchmetrics.Metric instances,"
                    f" got {name!r}: {type(metric).__name__}."
                )
        for arg, value in (("preds_key", preds_key), ("target_key", target_key)):
            if not isinstance(value, str):
                raise TypeError(f"`{arg}` should be a str, got {value!r}.")
        if isinstance(stages, str) or not isinstance(stages, Sequence) or not stages:
            raise ValueError(f"`stages` should be a non-empty list of 'validate', 'test', 'predict', got {stages!r}.")
        for stage in stages:
            if stage not in _STAGES:
                raise ValueError(f"`stages` should hold only 'validate', 'test', 'predict', got {stage!r}.")
        if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):
            raise TypeError(f"`output_dir` should be a path or None, got {output_dir!r}.")
        if pad_value is not None and (isinstance(pad_value, bool) or not isinstance(pad_value, (int, float))):
            raise TypeError(f"`pad_value` should be a number or None, got {pad_value!r}.")
        self.metrics = metrics or {}
        self.preds_key = preds_key
        self.target_key = target_key
        self.stages = tuple(stages)
        self.output_dir = None if output_dir is None else str(output_dir)
        self.pad_value = pad_value
        self.results: dict[str, Any] = {}
        self.paths: dict[str, str] = {}
        self.metric_values: dict[str, Any] = {}
        self._uid = uuid.uuid4().hex  # pairs this callback with its copy in spawned workers
        self._samplers: dict[str, list[tuple[SequentialDistributedSampler, int]]] = {}
        self._buffers: dict[int, list[Any]] = defaultdict(list)
        self._batches: dict[int, int] = defaultdict(int)
        self._sources: list[Any] = []
        _install_launcher_hooks()

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        _install_launcher_hooks()  # spawned workers import this module afresh
        loops = {
            "fit": [("validate", trainer.fit_loop.epoch_loop.val_loop)],
            "validate": [("validate", trainer.validate_loop)],
            "test": [("test", trainer.test_loop)],
            "predict": [("predict", trainer.predict_loop)],
        }
        for name, loop in loops.get(stage, []):
            if name in self.stages:
                self._wrap_source(trainer, name, loop._data_source)
        if self.output_dir is not None and trainer.is_global_zero:
            Path(self.output_dir).mkdir(parents=True, exist_ok=True)

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, "validate", outputs, dataloader_idx)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer, pl_module, "validate")

    @override
    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()

    @override
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, "test", outputs, dataloader_idx)

    @override
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer, pl_module, "test")

    @override
    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()

    @override
    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, "predict", outputs, dataloader_idx)

    @override
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer, pl_module, "predict")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for source in self._sources:
            vars(source).pop("dataloader", None)  # back to the class method
        self._sources = []
        self._reset()

    def _wrap_source(self, trainer: Trainer, stage: str, source: Any) -> None:
        """Swap samplers where Lightning requests the dataloaders, before it injects its own."""
        if "dataloader" in vars(source):
            return
        original = source.dataloader

        def dataloader() -> Any:
            return self._sequential_loaders(trainer, stage, original())

        source.dataloader = dataloader
        self._sources.append(source)

    def _sequential_loaders(self, trainer: Trainer, stage: str, dataloaders: Any) -> CombinedLoader:
        combined = dataloaders if isinstance(dataloaders, CombinedLoader) else CombinedLoader(dataloaders, "sequential")
        if combined._mode != "sequential":
            raise ValueError(
                f"SequentialEvaluation needs `CombinedLoader(mode='sequential')` for {stage},"
                f" got mode {combined._mode!r}."
            )
        hook = f"{_PREFIX[stage]}_dataloader"
        swapped, self._samplers[stage] = [], []
        for dl in combined.flattened:
            sampler = SequentialDistributedSampler(
                _check_replaceable(dl, hook), num_replicas=trainer.world_size, rank=trainer.global_rank
            )
            self._samplers[stage].append((sampler, dl.batch_size))
            swapped.append(_update_dataloader(dl, sampler))
        combined.flattened = swapped
        return combined

    def _reset(self) -> None:
        self._buffers = defaultdict(list)
        self._batches = defaultdict(int)

    def _collect(self, trainer: Trainer, stage: str, outputs: Any, dataloader_idx: int) -> None:
        if trainer.sanity_checking or stage not in self._samplers:
            return
        self._batches[dataloader_idx] += 1
        self._buffers[dataloader_idx].append(_to_cpu(outputs))

    def _finish(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.sanity_checking or stage not in self._samplers:
            self._reset()
            return
        gathered_all, values = [], {}
        several = len(self._samplers[stage]) > 1
        for idx, (sampler, batch_size) in enumerate(self._samplers[stage]):
            local, error = None, None
            try:
                local = self._rank_rows(stage, self._buffers.pop(idx, []), self._batches[idx], sampler, batch_size)
            except (TypeError, ValueError, RuntimeError) as exc:  # raised on every rank by the gather below
                error = str(exc)
            gathered = _concat(local, sampler.dataset_length, pad_value=self.pad_value, error=error)
            gathered_all.append(gathered)
            if self.metrics and stage != "predict":
                suffix = f"/dataloader_idx_{idx}" if several else ""
                values.update(self._log_metrics(pl_module, stage, gathered, suffix))
        self._reset()
        if values:
            self.metric_values[stage] = values
        if not trainer.is_global_zero:
            return
        result = gathered_all if several else gathered_all[0]
        if self.output_dir is None:
            self.results[stage] = result
            return
        path = save_atomic(result, Path(self.output_dir) / f"{stage}.pt")
        self.paths[stage] = str(path)
        self.results.pop(stage, None)

    def _rank_rows(self, stage: str, batches: list[Any], num_batches: int, sampler: Any, batch_size: int) -> Any:
        """This rank's outputs, concatenated over batches, without the sampler's padding."""
        if all(out is None for out in batches):
            return None
        local = _concat_batches(batches, self.pad_value, _STEP[stage])
        rows = _num_rows(local, _STEP[stage])
        expected = min(len(sampler), num_batches * batch_size)
        if rows != expected:
            raise ValueError(
                f"`{_STEP[stage]}` returned {rows} rows for the {expected} samples of this rank; SequentialEvaluation"
                " needs one row per sample (dim 0 is the batch), e.g. `{'preds': logits, 'target': y}`."
            )
        if expected < len(sampler):
            rank_zero_warn(
                f"SequentialEvaluation: `limit_{_PREFIX[stage]}_batches` evaluates {expected} of {len(sampler)} samples"
                " per rank, so the gathered results are a subset of the dataset and not in dataset order."
            )
        return _truncate(local, min(rows, sampler.num_real_samples))

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
            local.distributed_available_fn = _never_distributed  # the data is already global
            local.update(gathered[self.preds_key], gathered[self.target_key])
            value = local.compute()
            key = f"{_PREFIX[stage]}/{name}{suffix}"
            values[key] = value
            if isinstance(value, Tensor) and value.numel() == 1:
                # every rank holds the same value; "max" keeps it bit-exact while keeping ranks in step
                pl_module.log(key, value.float(), sync_dist=True, reduce_fx="max", add_dataloader_idx=False)
        return values

    def __getstate__(self) -> dict[str, Any]:
        # copies sent to spawned workers start empty: results only ever travel back, never out
        state = self.__dict__.copy()
        state.update(results={}, paths={}, metric_values={}, _samplers={}, _sources=[])
        state.update(_buffers=defaultdict(list), _batches=defaultdict(int))
        return state

    def _export(self) -> str:
        """Write this rank's results to a temporary file; the path travels, not the bytes.

        Like Lightning's own weights hand-off: the launcher's queue is read only after every
        worker has exited, so a payload larger than a pipe buffer would block rank 0 forever.
        """
        fd, path = tempfile.mkstemp(prefix="ddp_plugins_eval_", suffix=".pt")
        with os.fdopen(fd, "wb") as file:
            torch.save({"results": self.results, "paths": self.paths, "metric_values": self.metric_values}, file)
        return path

    def _import(self, path: str) -> None:
        try:
            state = torch.load(path, weights_only=False)  # written by this class in our own worker
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
    if dl.drop_last:
        raise ValueError(f"`{hook}` has `drop_last=True`, which skips samples; SequentialEvaluation needs every one.")
    if type(dl.sampler) not in (SequentialSampler, RandomSampler, DistributedSampler, SequentialDistributedSampler):
        raise TypeError(
            f"`{hook}` uses the custom sampler {type(dl.sampler).__name__}, which SequentialEvaluation cannot replace"
            " without changing which samples are evaluated. Allowed: no sampler, SequentialSampler, RandomSampler,"
            " DistributedSampler. Drop the sampler, or leave this stage out of `stages`."
        )
    return dataset


def _never_distributed() -> bool:
    return False


def _to_cpu(data: Any) -> Any:
    if isinstance(data, Tensor):
        return data.detach().cpu()
    if isinstance(data, Mapping):
        return {key: _to_cpu(value) for key, value in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_to_cpu(value) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_to_cpu(value) for value in data)
    return data


def _is_rows(value: Any) -> bool:
    """A list of Python objects, one per row (not a list of tensors or containers)."""
    return isinstance(value, list) and (
        not value or any(not isinstance(item, (Tensor, Mapping, list, tuple)) for item in value)
    )


def _flatten(data: Any, path: str = "") -> tuple[Any, list[tuple[str, Any]]]:
    """A comparable description of the structure, and its leaves with their paths."""
    if data is None:
        return "None", []
    if isinstance(data, Tensor) or _is_rows(data):
        return "leaf", [(path or "data", data)]
    if isinstance(data, Mapping):
        specs, leaves = [], []
        for key, value in data.items():
            spec, sub = _flatten(value, f"{path}[{key!r}]")
            specs.append((repr(key), spec))
            leaves += sub
        return ("dict", tuple(specs)), leaves
    if isinstance(data, (list, tuple)):
        specs, leaves = [], []
        for i, value in enumerate(data):
            spec, sub = _flatten(value, f"{path}[{i}]")
            specs.append(spec)
            leaves += sub
        return (type(data).__name__, tuple(specs)), leaves
    raise TypeError(
        f"`data` should hold tensors, lists of row values or dicts/tuples/lists of those,"
        f" got {type(data).__name__} at {path or 'the top'}."
    )


def _unflatten(data: Any, leaves: Any) -> Any:
    """Rebuild the structure of ``data`` with leaves taken in order from the iterator ``leaves``."""
    if data is None:
        return None
    if isinstance(data, Tensor) or _is_rows(data):
        return next(leaves)
    if isinstance(data, Mapping):
        return {key: _unflatten(value, leaves) for key, value in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_unflatten(value, leaves) for value in data))
    return type(data)(_unflatten(value, leaves) for value in data)


def _describe(leaf: Any) -> tuple:
    if isinstance(leaf, Tensor):
        return ("tensor", str(leaf.dtype).replace("torch.", ""), tuple(leaf.shape))
    return ("rows", "list", (len(leaf),))


def _fmt(meta: tuple) -> str:
    return f"{meta[1]}[{', '.join(map(str, meta[2]))}]"


def _pad(tensor: Tensor, shape: tuple, pad_value: float | None) -> Tensor:
    """``tensor`` placed at the start of a tensor of ``shape`` filled with ``pad_value``."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    out = torch.full(shape, 0 if pad_value is None else pad_value, dtype=tensor.dtype, device=tensor.device)
    if tensor.numel():
        out[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


def _concat_batches(batches: list[Any], pad_value: float | None, step: str) -> Any:
    """Concatenate one rank's per-batch outputs along dim 0, leaf by leaf."""
    flat = []
    for i, out in enumerate(batches):
        spec, leaves = _flatten(out)
        if flat and spec != flat[0][0]:
            raise ValueError(f"`{step}` returned a different structure in batch {i} than in batch 0.")
        flat.append((spec, [leaf for _, leaf in leaves]))
    names = [name for name, _ in _flatten(batches[0])[1]]
    merged = []
    for j, name in enumerate(names):
        parts = [leaves[j] for _, leaves in flat]
        if not isinstance(parts[0], Tensor):
            merged.append([item for part in parts for item in part])
            continue
        if any(part.dim() == 0 for part in parts):
            raise ValueError(
                f"`{step}` returned a 0-dim tensor at {name}; SequentialEvaluation needs one row per sample."
            )
        trailing = {tuple(part.shape[1:]) for part in parts}
        if len(trailing) > 1:
            if pad_value is None or len({part.dim() for part in parts}) > 1:
                raise ValueError(
                    f"`{step}` returned {name} with shapes {sorted(trailing)} across batches; pass `pad_value` to pad"
                    " variable-length outputs."
                )
            width = tuple(max(sizes) for sizes in zip(*trailing))
            parts = [_pad(part, (part.shape[0], *width), pad_value) for part in parts]
        merged.append(torch.cat(parts))
    return _unflatten(batches[0], iter(merged))


def _num_rows(data: Any, step: str) -> int:
    rows = {name: len(leaf) for name, leaf in _flatten(data)[1]}
    if len(set(rows.values())) > 1:
        raise ValueError(f"`{step}` returned leaves with different numbers of rows: {rows}.")
    return next(iter(rows.values()), 0)


def _truncate(data: Any, n: int) -> Any:
    return _unflatten(data, iter([leaf[:n] for _, leaf in _flatten(data)[1]]))


def _comm_device(group: Any, tensor: Tensor) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    return tensor.device


def _concat(
    data: Any,
    num_total_examples: int | None,
    *,
    pad_value: float | None = None,
    group: Any = None,
    error: str | None = None,
) -> Any:
    """:func:`distributed_concat`, plus ``error``: a failure found on this rank, raised on every rank."""
    if num_total_examples is not None and (
        isinstance(num_total_examples, bool) or not isinstance(num_total_examples, int) or num_total_examples < 0
    ):
        raise ValueError(f"`num_total_examples` should be an int >= 0 or None, got {num_total_examples!r}.")
    if pad_value is not None and (isinstance(pad_value, bool) or not isinstance(pad_value, (int, float))):
        raise TypeError(f"`pad_value` should be a number or None, got {pad_value!r}.")
    spec, leaves = None, []
    if error is None:
        try:
            spec, leaves = _flatten(data)
        except TypeError as exc:
            error = str(exc)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not distributed:
        if error is not None:
            raise ValueError(error)
        all_meta = [(spec, [_describe(leaf) for _, leaf in leaves], [leaf for _, leaf in leaves if _is_rows(leaf)])]
    else:
        # one collective carries every rank's structure, shapes, errors and row lists, so all ranks raise alike
        meta = (spec, [_describe(leaf) for _, leaf in leaves], [leaf for _, leaf in leaves if _is_rows(leaf)], error)
        gathered_meta: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered_meta, meta, group=group)
        failed = [(rank, m[3]) for rank, m in enumerate(gathered_meta) if m[3] is not None]
        if failed:
            raise ValueError("; ".join(f"rank {rank}: {message}" for rank, message in failed))
        all_meta = [m[:3] for m in gathered_meta]
    _check_consistent(all_meta, [name for name, _ in leaves], pad_value)
    outs, row_leaf = [], 0
    for j, (_, leaf) in enumerate(leaves):
        if _is_rows(leaf):
            outs.append([item for m in all_meta for item in m[2][row_leaf]])
            row_leaf += 1
        elif not distributed:
            outs.append(leaf)
        else:
            outs.append(_gather_tensor(leaf, [m[1][j][2] for m in all_meta], pad_value, group))
    result = _unflatten(data, iter(outs))
    return result if num_total_examples is None else _truncate(result, num_total_examples)


def _check_consistent(all_meta: list[Any], names: list[str], pad_value: float | None) -> None:
    def table() -> str:
        return "; ".join(
            f"rank {rank}: " + ", ".join(f"{name} {_fmt(meta)}" for name, meta in zip(names, m[1]))
            for rank, m in enumerate(all_meta)
        )

    if len({repr(m[0]) for m in all_meta}) > 1:
        shown = "; ".join(f"rank {rank}: {m[0]}" for rank, m in enumerate(all_meta))
        raise ValueError(f"`data` has a different structure on each rank, so it cannot be concatenated: {shown}.")
    for j, name in enumerate(names):
        metas = [m[1][j] for m in all_meta]
        if len({meta[:2] for meta in metas}) > 1:
            raise ValueError(f"`data` {name} has a different dtype on each rank: {table()}.")
        shapes = [meta[2] for meta in metas if meta[0] == "tensor" and meta[2] and meta[2][0] > 0]
        if len({len(shape) for shape in shapes}) > 1 or any(len(meta[2]) == 0 for meta in metas):
            raise ValueError(f"`data` {name} needs the same number of dims (>= 1) on every rank: {table()}.")
        if len({shape[1:] for shape in shapes}) > 1 and pad_value is None:
            raise ValueError(
                f"`data` {name} has different trailing shapes on each rank (pass `pad_value` to pad them): {table()}."
            )


def _gather_tensor(tensor: Tensor, shapes: list[tuple], pad_value: float | None, group: Any) -> Tensor:
    """Pad to the largest shape, gather into one buffer, trim each rank's rows, concatenate.

    Gathering into one preallocated buffer (``all_gather_single``) instead of a list of tensors
    saves the ``torch.cat`` copy of the anchor; when only trailing ranks hold fewer rows the
    result is a view of that buffer.
    """
    filled = [shape for shape in shapes if shape[0] > 0] or shapes
    trailing = tuple(max(sizes) for sizes in zip(*(shape[1:] for shape in filled)))
    rows = [shape[0] for shape in shapes]
    if max(rows) == 0:
        return tensor.new_empty((0, *trailing))
    device = _comm_device(group, tensor)
    local = _pad(tensor.to(device), (max(rows), *trailing), pad_value).contiguous()
    out = torch.empty((len(rows) * max(rows), *trailing), dtype=tensor.dtype, device=device)
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather_single(out, local, group=group)
    last = max(r for r, n in enumerate(rows) if n)
    if all(n == max(rows) for n in rows[:last]):  # only trailing ranks are short (the sampler's case): a view
        return out[: sum(rows)].to(tensor.device)
    return torch.cat([out[r * max(rows) : r * max(rows) + n] for r, n in enumerate(rows)]).to(tensor.device)


def _install_launcher_hooks() -> None:
    """Carry every SequentialEvaluation's results from spawned rank 0 to the calling process, once."""
    cls = _MultiProcessingLauncher
    if getattr(cls, "_ddp_plugins_sequential_evaluation", False):
        return
    original_get, original_update = cls.get_extra_results, cls.update_main_process_results

    @functools.wraps(original_get)
    def get_extra_results(self: Any, trainer: Trainer) -> dict[str, Any]:
        extra = original_get(self, trainer)
        payload = {cb._uid: cb._export() for cb in trainer.callbacks if isinstance(cb, SequentialEvaluation)}
        if payload:
            extra[_EXTRA_KEY] = payload
        return extra

    @functools.wraps(original_update)
    def update_main_process_results(self: Any, trainer: Trainer, extra: dict[str, Any]) -> None:
        original_update(self, trainer, extra)
        payload = extra.get(_EXTRA_KEY, {})
        for cb in trainer.callbacks:
            if isinstance(cb, SequentialEvaluation) and cb._uid in payload:
                cb._import(payload[cb._uid])

    cls.get_extra_results = get_extra_results
    cls.update_main_process_results = update_main_process_results
    cls._ddp_plugins_sequential_evaluation = True
