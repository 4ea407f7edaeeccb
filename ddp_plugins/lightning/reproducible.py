"""The strategy's reproducible mode; design and limits: docs/design.md, "The reproducible mode"."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from ddp_plugins import _compat
from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.core.plan import GlobalPlan, first_tensor_rows
from ddp_plugins.core.ranks import is_distributed
from ddp_plugins.core.reproducible import ShardedStep, exact_sum, fingerprint
from ddp_plugins.core.samplers import SequentialDistributedSampler
from ddp_plugins.core.trees import tree_map
from ddp_plugins.lightning.data_plan import run_accumulation
from ddp_plugins.lightning.rank_aware_seed import RankAwareSeed
from ddp_plugins.lightning.steps import (
    PlannedSteps,
    evaluation_sampler,
    is_mean,
    metrics_unchanged,
    padding_apart_loader,
    padding_batch,
)

__all__ = ["FINGERPRINT_KEY", "ReproducibleSteps", "state_fingerprint"]

FINGERPRINT_KEY = "ddp_plugins_state_fingerprint"  # in every checkpoint the strategy saves


def state_fingerprint(state_dict: Any, optimizer_states: Any) -> str:
    """The fingerprint of a module's ``state_dict`` and its optimizers' (a checkpoint's, or live ones).

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> state_fingerprint(model.state_dict(), []) == state_fingerprint(model.state_dict(), [])
        True
    """
    return fingerprint({"state_dict": state_dict, "optimizer_states": list(optimizer_states or [])})


_PRECISIONS = ("32-true", "64-true", "32", "64", "bf16-mixed", "bf16")


def _refuse(what: str, hint: str) -> ValueError:
    return ValueError(f"reproducible=True {what}. {hint}")


def check_trainer(trainer: Any, world_size: int, virtual_shards: int) -> None:
    """Refuse gradient accumulation, float16 precision, or more ranks than shards, before any rank starts."""
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


# the DDP options the mode bypasses (its sums run outside DDP's reducer), and the only value each may have
_BYPASSED: dict[str, Any] = {"comm_hook": "none", "ddp_comm_hook": None, "find_unused_parameters": False}


def check_shards(module: nn.Module, plan: GlobalPlan) -> None:
    """Refuse a plan with a virtual shard of 1 row where the model has a ``BatchNorm1d`` (it needs 2)."""
    layer = next((n for n, m in module.named_modules() if isinstance(m, nn.BatchNorm1d) and m.training), None)
    if layer is None:
        return
    steps = sorted({0, plan.steps_per_epoch - 1})  # every other step is as long as the first
    short = [step for step in steps if 1 in plan.shard_sizes(step)]
    if short:
        rows, most = plan.step_size(short[0]), max(1, min(plan.step_size(step) for step in steps) // 2)
        raise ArgumentValueError(
            "virtual_shards",
            f"at most {most} with reproducible=True, as BatchNorm1d {layer!r} normalizes each virtual shard (2 rows"
            " or more)",
            problem=f"got {plan.virtual_shards}: step {short[0]} has {rows} rows, which virtual_shards="
            f"{plan.virtual_shards} cut into shards of 1 row",
            hint=f"Use virtual_shards<={most} (the same for every run you compare), drop_last=True, or a"
            f" global_batch_size whose every step has at least {2 * (plan.virtual_shards or 1)} rows.",
        )


def check_deterministic(trainer: Any) -> None:
    """Refuse nondeterministic CUDA kernels before launch (unless a ``RankAwareSeed(deterministic=True)`` sets them)."""
    devices = getattr(trainer.strategy, "parallel_devices", None) or [trainer.strategy.root_device]
    seeded = any(isinstance(cb, RankAwareSeed) and cb.deterministic for cb in trainer.callbacks)
    if any(torch.device(d).type == "cuda" for d in devices) and not seeded:
        _check_kernels()


def _check_kernels() -> None:
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if not torch.are_deterministic_algorithms_enabled() or warn_only:
        got = "warn-only deterministic kernels (deterministic='warn')" if warn_only else "nondeterministic kernels"
        raise _refuse(
            f"on CUDA needs deterministic kernels, got {got}",
            "Use Trainer(deterministic=True): a kernel that only warns would change the bits.",
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
    if any(p.device.type == "cuda" for p in module.parameters()):
        _check_kernels()


def _dataset_rows(loader: Any) -> int | None:
    """The rows of a ``DataLoader``'s map-style dataset (``None`` for anything else: its length is known later)."""
    dataset = getattr(loader, "dataset", None)
    if type(loader) is not DataLoader or isinstance(dataset, IterableDataset):  # what plan_for plans
        return None
    try:
        return len(dataset) or None  # type: ignore[arg-type]
    except TypeError:
        return None


def _say_changed(started: list[str], stopped: list[str], step: int) -> None:
    """One line where a step trains other parameters than the one before (a layer unfrozen or frozen)."""

    def names(them: list[str]) -> str:
        return ", ".join(them[:4]) + (f" and {len(them) - 4} more" if len(them) > 4 else "")

    said = [f"{verb} {names(them)}" for verb, them in (("trains", started), ("no longer trains", stopped)) if them]
    rank_zero_info(f"ddp_plugins: reproducible mode: from step {step} on, the model {'; '.join(said)}.")


def _rows_of(a: int, b: int) -> Callable[[Any], Any]:
    """Cut a batch's tensors to rows ``[a, b)`` (other leaves as they are)."""
    return lambda t: t[a:b] if isinstance(t, Tensor) and t.dim() else t


class ReproducibleSteps(PlannedSteps):
    """The reproducible mode's steps: this rank's shards, their exact sums, evaluation means combined exactly."""

    def __init__(self, virtual_shards: int, global_batch_size: int | None = None, **ddp_options: Any) -> None:
        if global_batch_size is None:
            raise ArgumentValueError(
                "global_batch_size", "an integer with reproducible=True", None,
                hint="The mode cuts each step of global_batch_size rows into virtual shards.",
            )  # fmt: skip
        for name, allowed in _BYPASSED.items():
            if (value := ddp_options.get(name, allowed)) != allowed:
                raise ArgumentValueError(
                    name, f"{allowed!r} with reproducible=True", value,
                    hint="The mode sums the gradients exactly itself, outside DistributedDataParallel's reducer, which"
                    " is what runs comm hooks and finds unused parameters (unused ones get no gradient in this mode).",
                )  # fmt: skip
        super().__init__()
        self.virtual_shards: int = virtual_shards
        self.global_batch_size: int = global_batch_size
        self._step: ShardedStep | None = None
        self._eval: list[tuple[int, dict[str, Tensor]]] = []  # (real rows, values) per evaluation batch
        self._local = False  # the user's step runs: a logged value is this shard's or batch's, combined after it
        self._threads: int | None = None  # the CPU threads before setup set one

    def layer_sync(self, plugin: Any) -> Any:
        if plugin is not None:
            rank_zero_info("ddp_plugins: the reproducible mode normalizes BatchNorm per virtual shard, not synced.")
        return None

    def before_launch(self, trainer: Any, world_size: int, loader: Any = None, drop_last: bool = False) -> None:
        """Check the Trainer, the model and the shards' rows (of every step if ``loader`` has a length, else of G)."""
        check_trainer(trainer, world_size, self.virtual_shards)
        check_deterministic(trainer)
        module, size = trainer.lightning_module, self.global_batch_size
        if module is not None and trainer.state.fn == "fit":
            rows = _dataset_rows(loader)
            check_shards(module, GlobalPlan(rows or size, size, drop_last=bool(rows) and drop_last,
                                            virtual_shards=self.virtual_shards))  # fmt: skip

    def setup(self, trainer: Any) -> None:
        check_model(trainer.lightning_module)
        self._threads = torch.get_num_threads()  # CPU kernels (a convolution's) sum in another order with more
        torch.set_num_threads(1)
        rank_zero_info(
            f"ddp_plugins: reproducible mode: each step runs as {self.virtual_shards} virtual shards, summed"
            " exactly, one CPU thread per rank: the same bits on any number of ranks."
        )

    def teardown(self) -> None:
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None

    def training_step(
        self, trainer: Any, rows: Any, plan: GlobalPlan | None, context: Any, step: Callable[[], Any], args: tuple
    ) -> Any:
        """Run this rank's shards of the step (``args[0]`` holds their rows in order); return the step's mean loss."""
        assert plan is not None, "the reproducible mode trains on a global plan"
        module, batch, index = trainer.lightning_module, args[0], args[1]
        if self._step is None or self._step.module is not module:
            check_shards(module, plan)
            self._step = ShardedStep(module, self.virtual_shards, seed=plan.seed)
        results = _compat.running_results(trainer, "training_step")
        kept, batch_size, self._local = _compat.set_aside(results, "training_step"), results.batch_size, True
        first, stop = plan.rank_shards(trainer.world_size)[trainer.global_rank]
        values, logged, output, loss = [], {}, None, None
        try:
            ends = itertools.accumulate(plan.shard_sizes(index)[first:stop], initial=0)
            for shard, (a, b) in enumerate(itertools.pairwise(ends), start=first):
                results.batch_size = 1  # one value a shard: finish weights it by the shard's rows
                with self._step.shard(shard, b - a, trainer.current_epoch, index):
                    with context():
                        output = module.training_step(tree_map(_rows_of(a, b), batch), *args[1:])
                    loss = output["loss"] if isinstance(output, Mapping) else output
                    if not isinstance(loss, Tensor):
                        raise _refuse(
                            "needs training_step to return a loss", "Skipping a step would differ per world size."
                        )
                    loss.backward()
                logged = _taken(results, "training_step")
                values.append([loss.detach(), *(_compat.logged_value(entry) for entry in logged.values())])
            means = self._step.finish(step_rows=plan.step_size(index), values=values)
            if self._step.changed is not None:
                _say_changed(*self._step.changed, trainer.global_step)
            _put(results, kept, logged, means[1:], plan.step_size(index))
        finally:
            self._local, results.batch_size = False, batch_size
        assert loss is not None
        loss = means[0].to(loss.dtype)
        return {**output, "loss": loss} if isinstance(output, Mapping) else loss

    def backward(
        self, loss: Tensor, module: Any, rows: Any, precision: Any, backward: Callable[[Tensor], Tensor]
    ) -> Tensor:
        """The shards' backward ran in ``training_step``: the parameters get their exact sum."""
        loss = precision.pre_backward(loss, module)
        assert self._step is not None
        self._step.apply()
        return precision.post_backward(loss, module)

    def reduce(self, tensor: Any, group: Any, reduce_op: Any, reduce: Callable[..., Any]) -> Any:
        """A shard's value stays local; the mean of a value equal on all ranks is itself (all-reduce moves bits)."""
        if self._local:
            return tensor
        if is_mean(reduce_op) and is_distributed():
            everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
            dist.all_gather(everyone, tensor, group=group)
            if all(torch.equal(t, tensor) for t in everyone):
                return tensor
        return reduce(tensor, group, reduce_op)

    def evaluation_loader(self, dataloader: Any, world_size: int, rank: int) -> Any:
        """``dataloader`` cut into the dataset's batches, the same on any number of ranks, as many on each rank."""
        if isinstance(getattr(dataloader, "sampler", None), SequentialDistributedSampler):
            return dataloader  # SequentialEvaluation's, cut the same way
        apart = padding_apart_loader(dataloader, world_size, rank)
        if apart is None:
            dataset = getattr(dataloader, "dataset", None)
            batch_size, drop_last = getattr(dataloader, "batch_size", None), getattr(dataloader, "drop_last", None)
            raise _refuse(
                "evaluates the same batches on any number of ranks, which needs a map-style dataset in a loader"
                f" batched by `batch_size=` without drop_last, got {type(dataset).__name__} in a loader with"
                f" batch_size={batch_size}, drop_last={drop_last}",
                "Give the evaluation loader a dataset with a length, a batch_size and drop_last=False.",
            )
        return apart

    def evaluation_step(self, trainer: Any, hook: str, args: tuple, step: Callable[[], Any]) -> Any:
        """Keep the step's ``sync_dist`` means out of Lightning's sums; log their exact combination at the end."""
        if len(args) < 2:
            return step()
        loader = args[2] if len(args) > 2 else 0
        sampler = evaluation_sampler(trainer, args)
        # a padding batch counts for nothing (so does SequentialEvaluation's padding row past the dataset's end)
        padding = padding_batch(trainer, args, sampler) or (
            isinstance(sampler, SequentialDistributedSampler) and not sampler.num_real_samples
        )
        results = _compat.running_results(trainer, hook)
        kept, self._local = _compat.set_aside(results, hook, synced_only=True), True
        try:
            with metrics_unchanged(trainer.lightning_module) if padding else contextlib.nullcontext():
                output = step()
        finally:
            self._local = False
        logged = _taken(results, hook, synced_only=True)
        values = {key: _compat.logged_value(entry) for key, entry in logged.items()}
        _put(results, kept, logged)
        rows = 0 if padding else max(first_tensor_rows(args[0]), 0)
        if values:
            self._eval.append((rows, values))
        counts = (
            trainer.num_sanity_val_batches if trainer.sanity_checking
            else trainer.num_test_batches if trainer.testing else trainer.num_val_batches
        )  # fmt: skip
        if args[1] == counts[loader] - 1:
            for key, (mean, total) in self._evaluation_means().items():
                results.update_metrics(key, mean.to(torch.get_default_dtype()), total)
        return output

    def _evaluation_means(self) -> dict[str, tuple[Tensor, int]]:
        """The logged means of the loader's batches, combined exactly over all ranks (every rank calls it)."""
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
        for name, total, rows in zip(names, sums, sums[len(names) :], strict=False):  # the sums, then the rows
            if total is not None and rows is not None and float(rows) > 0:
                out[name] = (total / rows, int(rows))
        return out


def _taken(results: Any, hook: str, synced_only: bool = False) -> dict[str, Any]:
    """What the user's step just logged, taken out of ``results``; refused where no exact combination exists."""
    for key, entry in results.items():
        state = {} if entry.is_tensor or not key.startswith(hook) else entry.value.metric_state
        floats = [k for k, v in state.items() if isinstance(v, Tensor) and v.is_floating_point()]
        if floats:  # integer counts (accuracy's) and concatenated rows sum the same in any grouping; floats do not
            raise _refuse(
                f"cannot combine the torchmetrics {type(entry.value).__name__} logged as {entry.meta.name!r} exactly:"
                f" its state {floats[0]!r} is a float sum per rank",
                "Log a tensor value (a mean is combined exactly), or give the metric to"
                " SequentialEvaluation(metrics=...), which computes it once over every row.",
            )
    taken = _compat.set_aside(results, hook, synced_only)
    for entry in taken.values():
        if not entry.meta.is_mean_reduction:
            fx = entry.meta.reduce_fx.__name__
            raise _refuse(
                f"combines logged values by their mean, got reduce_fx={fx!r} for {entry.meta.name!r}", "Log a mean."
            )
    return taken


def _put(results: Any, kept: dict[str, Any], logged: dict[str, Any], means: Any = (), rows: int = 0) -> None:
    """Put back the entries set aside (an empty one for a new name), then log each of ``means`` for ``rows`` rows."""
    results.update(kept)
    for key, entry in logged.items():
        if key not in results:
            entry.reset()
            results[key] = entry
    for key, mean in zip(logged, means, strict=False):
        results.update_metrics(key, mean.to(torch.get_default_dtype()), rows)
