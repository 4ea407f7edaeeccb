"""The strategy's reproducible mode (``DDPPluginsStrategy(global_batch_size=G, reproducible=True)``).

Each training step runs this rank's virtual shards one by one (:class:`~ddp_plugins.core.reproducible.ShardedStep`),
outside ``DistributedDataParallel``'s reducer, and hands Lightning the exactly reduced gradients
at its backward; the values the module logs are combined exactly too (training: per step;
evaluation: per epoch). Design and limits in docs/design.md ("The reproducible mode").
"""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset
from torchmetrics import Metric

from ddp_plugins._compat import update_dataloader
from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.core.plan import GlobalPlan, first_tensor_rows
from ddp_plugins.core.ranks import is_distributed
from ddp_plugins.core.reproducible import ShardedStep, exact_sum, fingerprint
from ddp_plugins.core.samplers import SequentialDistributedSampler
from ddp_plugins.core.trees import tree_map
from ddp_plugins.lightning.data_plan import run_accumulation

__all__ = ["FINGERPRINT_KEY", "ReproducibleSteps", "reduction_name", "state_fingerprint"]

FINGERPRINT_KEY = "ddp_plugins_state_fingerprint"  # in every checkpoint the strategy saves


def state_fingerprint(state_dict: Any, optimizer_states: Any) -> str:
    """The fingerprint of a module's ``state_dict`` and its optimizers' (a checkpoint's, or live ones).

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> state_fingerprint(model.state_dict(), []) == state_fingerprint(model.state_dict(), [])
        True
    """
    return fingerprint({"state_dict": state_dict, "optimizer_states": list(optimizer_states or [])})


# bf16 autocast runs inside each shard, on the same rows on any number of ranks: the same kernels and bits
_PRECISIONS = ("32-true", "64-true", "32", "64", "bf16-mixed", "bf16")


def _refuse(what: str, hint: str) -> ValueError:
    return ValueError(f"reproducible=True {what}. {hint}")


def check_trainer(trainer: Any, world_size: int, virtual_shards: int) -> None:
    """What the mode needs of the Trainer, checked before any rank starts (one line each).

    Raises:
        ArgumentValueError: gradient accumulation, float16 precision, or more ranks than shards.
    """
    accumulate = run_accumulation(trainer)
    if accumulate != 1:
        raise ArgumentValueError(
            "accumulate_grad_batches", "1 with reproducible=True", accumulate,
            hint="The mode cuts each step into virtual shards itself: global_batch_size is the step's rows.",
        )  # fmt: skip
    if str(trainer.precision) not in _PRECISIONS:
        raise ArgumentValueError(
            "precision", "'32-true', '64-true' or 'bf16-mixed' with reproducible=True", str(trainer.precision),
            hint="float16 needs a loss scaler, whose skipped steps the mode does not reproduce; bf16-mixed needs none.",
        )  # fmt: skip
    if world_size > virtual_shards:
        raise ArgumentValueError(
            "devices", f"at most virtual_shards={virtual_shards} ranks in all with reproducible=True", world_size,
            hint="Raise strategy virtual_shards (the same for every run you compare) or use fewer ranks.",
        )  # fmt: skip


def check_options(**options: Any) -> None:
    """DDP options that the mode would bypass are refused, not ignored: its exact sums run outside
    ``DistributedDataParallel``'s reducer, which is what runs comm hooks and finds unused parameters.

    Example::

        >>> check_options(comm_hook="none", find_unused_parameters=False)
        >>> check_options(comm_hook="fp16")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `comm_hook` should be 'none' with reproducible=True, got 'fp16'. ...
    """
    for name, value in options.items():
        if value != _BYPASSED[name]:
            raise ArgumentValueError(
                name, f"{_BYPASSED[name]!r} with reproducible=True", value,
                hint="The mode sums the gradients exactly itself, outside DistributedDataParallel's reducer, which"
                " is what runs comm hooks and finds unused parameters (unused ones get no gradient in this mode).",
            )  # fmt: skip


_BYPASSED: dict[str, Any] = {"comm_hook": "none", "ddp_comm_hook": None, "find_unused_parameters": False}


def check_shards(module: nn.Module, plan: GlobalPlan) -> None:
    """Refuse a plan whose virtual shards are too small for the model's ``BatchNorm1d`` layers.

    BatchNorm normalizes each shard on its own, and a ``BatchNorm1d`` over ``(rows, features)``
    needs two rows or more; the refusal names the step and what would work.
    """
    if not any(isinstance(m, nn.BatchNorm1d) and m.training for m in module.modules()):
        return
    for step in sorted({0, plan.steps_per_epoch - 1}):  # every other step is as long as the first
        sizes = plan.shard_sizes(step)
        if any(size == 1 for size in sizes):
            rows, most = sum(sizes), max(1, sum(sizes) // 2)
            raise _refuse(
                f"normalizes BatchNorm1d over each virtual shard, but step {step} has {rows} rows, which"
                f" virtual_shards={plan.virtual_shards} cut into shards of 1 row (BatchNorm1d needs 2 or more)",
                f"Use virtual_shards<={most} (the same for every run you compare), drop_last=True, or a"
                f" global_batch_size whose every step has at least {2 * (plan.virtual_shards or 1)} rows.",
            )


def check_model(module: nn.Module) -> None:
    """Refuse what would break the guarantee in the model (one line)."""
    if not getattr(module, "automatic_optimization", True):
        raise _refuse("needs automatic optimization", "Manual optimization steps the shards itself.")
    synced = [n for n, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if synced:
        raise _refuse(
            f"normalizes per virtual shard, but {synced[0]!r} is a SyncBatchNorm",
            "Use plain BatchNorm (SyncBatchNormCallback steps aside in this mode).",
        )
    cuda = any(p.device.type == "cuda" for p in module.parameters())
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if cuda and (not torch.are_deterministic_algorithms_enabled() or warn_only):
        got = "warn-only deterministic kernels (deterministic='warn')" if warn_only else "nondeterministic kernels"
        raise _refuse(
            f"on CUDA needs deterministic kernels, got {got}",
            "Use Trainer(deterministic=True): a kernel that only warns would change the bits.",
        )


class _LogRecorder:
    """``LightningModule.log`` while shards or evaluation batches run: tensor values with a mean
    reduction are kept for an exact combination; anything else (a torchmetrics ``Metric``,
    ``sync_dist=False`` in evaluation) goes to Lightning as it is."""

    def __init__(self, log: Callable[..., None], training: bool) -> None:
        self.log = log
        self.training = training
        self.values: dict[str, Tensor] = {}
        self.kwargs: dict[str, dict[str, Any]] = {}

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        floats = [k for k, v in value.metric_state.items() if isinstance(v, Tensor) and v.is_floating_point()] if (
            isinstance(value, Metric)
        ) else []  # fmt: skip
        if floats:  # integer counts (accuracy's) and concatenated rows sum the same in any grouping; floats do not
            raise _refuse(
                f"cannot combine the torchmetrics {type(value).__name__} logged as {name!r} exactly: its state"
                f" {floats[0]!r} is a float sum per rank",
                "Log a tensor value (a mean is combined exactly), or give the metric to"
                " SequentialEvaluation(metrics=...), which computes it once over every row.",
            )
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = torch.tensor(float(value))
        scalar = isinstance(value, Tensor) and value.numel() == 1 and not args
        if not scalar or not (self.training or kwargs.get("sync_dist")):
            return self.log(name, value, *args, **kwargs)
        if (fx := reduction_name(kwargs)) not in ("mean", "avg"):
            raise _refuse(f"combines logged values by their mean, got reduce_fx={fx!r} for {name!r}", "Log a mean.")
        self.values[name] = value.detach().double().reshape(())
        self.kwargs[name] = {k: v for k, v in kwargs.items() if k not in ("sync_dist", "batch_size", "reduce_fx")}


def reduction_name(log_kwargs: Mapping[str, Any]) -> str:
    """The lower-case name of a ``self.log`` call's ``reduce_fx`` (a string or a function; ``"mean"`` by default).

    Example::

        >>> reduction_name({}), reduction_name({"reduce_fx": torch.max}), reduction_name({"reduce_fx": "SUM"})
        ('mean', 'max', 'sum')
    """
    fx = log_kwargs.get("reduce_fx", "mean")
    return (fx if isinstance(fx, str) else getattr(fx, "__name__", "")).lower()


def _log_combined(module: Any, name: str, value: Tensor, **kwargs: Any) -> None:
    """Log a value already combined exactly over every rank as it is (``sync_dist=False``).

    Lightning hints at ``sync_dist=True`` for an epoch-level value logged so; its float all_reduce
    would change the bits, so the hint is silenced for this name (training and evaluation alike).
    """
    hint = f"It is recommended to use `self.log\\({re.escape(repr(name))}, ..., sync_dist=True\\)`"
    warnings.filterwarnings("ignore", hint, UserWarning)
    module.log(name, value.float(), sync_dist=False, **kwargs)


@contextmanager
def _recording(module: Any, training: bool) -> Any:
    recorder = _LogRecorder(module.log, training)
    module.log = recorder
    try:
        yield recorder
    finally:
        del module.log


def _rows_of(a: int, b: int) -> Callable[[Any], Any]:
    """Cut a batch's tensors to rows ``[a, b)`` (other leaves as they are)."""
    return lambda t: t[a:b] if isinstance(t, Tensor) and t.dim() else t


class ReproducibleSteps:
    """The reproducible mode's state in a strategy: the shards of each step, the pending
    gradients, the evaluation's logged values and the callback that logs them at epoch end."""

    def __init__(self, virtual_shards: int) -> None:
        self.virtual_shards = virtual_shards
        self._step: ShardedStep | None = None
        self._eval: list[tuple[int, dict[str, Tensor]]] = []  # (real rows, values) per evaluation batch
        self._eval_kwargs: dict[str, dict[str, Any]] = {}
        self.callback = _EvalLogs(self)

    def training_step(
        self, module: Any, plan: GlobalPlan, rank: int, world_size: int, args: tuple, context: Any
    ) -> Any:
        """Run this rank's shards of the step (``args[0]`` holds their rows in order); return the step's mean loss."""
        batch, step, epoch = args[0], args[1], module.trainer.current_epoch
        if self._step is None or self._step.module is not module:
            check_shards(module, plan)
            self._step = ShardedStep(module, self.virtual_shards, seed=plan.seed)
        first, stop = plan.rank_shards(world_size)[rank]
        values, output = [], None
        ends = itertools.accumulate(plan.shard_sizes(step)[first:stop], initial=0)
        for shard, (a, b) in enumerate(itertools.pairwise(ends), start=first):
            with _recording(module, training=True) as logs, self._step.shard(shard, b - a, epoch, step):
                with context():
                    output = module.training_step(tree_map(_rows_of(a, b), batch), *args[1:])
                loss = output["loss"] if isinstance(output, Mapping) else output
                if not isinstance(loss, Tensor):
                    raise _refuse(
                        "needs training_step to return a loss", "Skipping a step would differ per world size."
                    )
                loss.backward()
            values.append([loss.detach(), *logs.values.values()])
            names, kwargs = list(logs.values), logs.kwargs
        means = self._step.finish(step_rows=plan.step_size(step), values=values)
        for name, value in zip(names, means[1:], strict=True):
            _log_combined(module, name, value, batch_size=plan.step_size(step), **kwargs[name])
        loss = means[0].to(loss.dtype)
        return {**output, "loss": loss} if isinstance(output, Mapping) else loss

    def apply_gradients(self) -> None:
        """Give the parameters the step's reduced gradients (at Lightning's backward)."""
        assert self._step is not None
        self._step.apply()

    @staticmethod
    def evaluation_loader(dataloader: Any, world_size: int, rank: int) -> Any:
        """``dataloader`` cut into the same batches on any number of ranks, each rank whole batches in order.

        Lightning's ``DistributedSampler`` deals rows out one by one and repeats some to even out the
        ranks, so a batch's mean (and its padding) would depend on the number of ranks.

        Raises:
            ValueError: a loader that cannot be rebuilt so (an iterable dataset, no ``batch_size``).
        """
        if isinstance(getattr(dataloader, "sampler", None), SequentialDistributedSampler):
            return dataloader  # SequentialEvaluation's, aligned the same way
        dataset, batch_size = getattr(dataloader, "dataset", None), getattr(dataloader, "batch_size", None)
        if not isinstance(dataloader, DataLoader) or not batch_size or isinstance(dataset, IterableDataset):
            raise _refuse(
                "evaluates the same batches on any number of ranks, which needs a map-style dataset batched by"
                f" `batch_size=`, got {type(dataset).__name__} in a loader with batch_size={batch_size}",
                "Give the evaluation loader a dataset with a length and a batch_size.",
            )
        sampler = SequentialDistributedSampler(dataloader.dataset, num_replicas=world_size, rank=rank, align=batch_size)
        return update_dataloader(dataloader, sampler)

    @contextmanager
    def evaluation_batch(self, module: Any, batch: Any, batch_idx: int, sampler: Any) -> Any:
        """Keep the mean values an evaluation step logs with ``sync_dist``, weighted by the batch's real rows."""
        rows = max(first_tensor_rows(batch), 0)
        if isinstance(sampler, SequentialDistributedSampler) and not sampler.num_real_samples:
            rows = 0  # the padding batch of a rank past the dataset's end counts for nothing
        with _recording(module, training=False) as logs:
            yield
        if logs.values:
            self._eval.append((rows, logs.values))
            self._eval_kwargs.update(logs.kwargs)

    def evaluation_logs(self) -> dict[str, tuple[Tensor, int, dict[str, Any]]]:
        """The evaluation epoch's values, combined exactly over all ranks' batches (every rank calls it)."""
        entries, self._eval = self._eval, []
        names = list(dict.fromkeys(name for _, values in entries for name in values))
        if is_distributed():
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, names)
            names = list(dict.fromkeys(n for ranks in everyone for n in ranks))
        if not names:
            return {}
        one = torch.ones((), dtype=torch.float64)
        shards = [[*(v.get(n) for n in names), *(one if n in v else None for n in names)] for _, v in entries]
        like = [torch.zeros((), dtype=torch.float64)] * (2 * len(names))
        sums = exact_sum(shards, like, weights=[rows for rows, _ in entries])[0]
        out = {}
        for i, name in enumerate(names):
            total, rows = sums[i], sums[len(names) + i]
            if total is not None and rows is not None and float(rows) > 0:
                out[name] = (total / rows, int(rows), self._eval_kwargs.get(name, {}))
        return out


class _EvalLogs(Callback):
    """Logs the evaluation epoch's exactly combined values (added to the Trainer by the strategy)."""

    def __init__(self, steps: ReproducibleSteps) -> None:
        self.steps = steps

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        for name, (value, rows, kwargs) in self.steps.evaluation_logs().items():
            kwargs = {k: v for k, v in kwargs.items() if k not in ("on_step", "on_epoch")}
            _log_combined(pl_module, name, value, batch_size=rows, on_step=False, on_epoch=True, **kwargs)

    on_test_epoch_end = on_validation_epoch_end
