"""Every private Lightning, torch and Hydra name the pack uses, checked with torch 2.13.0, hydra-core 1.3.8
and Lightning 2.6.6 (``make test``) or 2.6.1 (``make matrix``), the only versions these install: ``CHECKED``,
``CHECKED_ATTRIBUTES`` and ``RESULT_MEMBERS``/``RESULT_CALLS`` are what ``tests/test_compat.py`` checks. Why each
is needed: ``docs/design.md``.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import math
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNormFunction
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

if TYPE_CHECKING:
    from hydra.core.config_search_path import ConfigSearchPath

#: The oldest torch the pack runs on (``pyproject.toml``; ``make matrix`` tests it). An older one is refused here,
#: at ``import ddp_plugins``, in one line, rather than failing later in a name it lacks.
TORCH_FLOOR = (2, 10)
_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if _TORCH < TORCH_FLOOR:
    _floor = ".".join(map(str, TORCH_FLOOR))
    raise ImportError(
        f"ddp_plugins needs torch {_floor} or newer, got torch {torch.__version__}: pip install 'torch>={_floor}'"
    )

#: torch 2.13 gave batch norm ``bias=False`` (a weight without a bias); before it, ``affine`` sets both.
BATCHNORM_TAKES_BIAS = "bias" in inspect.signature(BatchNormBase.__init__).parameters
#: Dynamo traces the SyncBN function whole from torch 2.12; 2.10 breaks the graph inside it, and 2.11 (aot_eager)
#: gets its input gradient wrong, so there it runs eagerly inside a compiled model (docs/compatibility.md).
DYNAMO_TRACES_SYNCBN = _TORCH >= (2, 12)
#: On torch 2.12 and 2.13 dynamo fails inside ``self.log`` when a LightningModule is compiled whole; 2.10, 2.11
#: and 2.14 train it.
DYNAMO_FAILS_IN_SELF_LOG = (2, 12) <= _TORCH < (2, 14)

__all__ = [
    "CHECKED",
    "CHECKED_ATTRIBUTES",
    "RESULT_CALLS",
    "RESULT_MEMBERS",
    "BATCHNORM_TAKES_BIAS",
    "DYNAMO_FAILS_IN_SELF_LOG",
    "DYNAMO_TRACES_SYNCBN",
    "TORCH_FLOOR",
    "epoch_sums",
    "restore_epoch_sums",
    "BatchNormBase",
    "TorchSyncBatchNormFunction",
    "combined_loader_mode",
    "compiled_by_lightning",
    "default_store",
    "hydra_config_search_path",
    "hydra_create_main",
    "hydra_sweep_batches",
    "add_to_epoch_sum",
    "logger_step",
    "logged_value",
    "loop_data_source",
    "running_results",
    "set_aside",
    "set_group_timeout",
    "set_num_threads_if_needed",
    "strategy_comm_hook",
    "strategy_comm_state_and_wrapper",
    "subprocess_cmd",
    "training_epoch_results",
    "update_dataloader",
]

CHECKED: tuple[tuple[str, str], ...] = (
    ("torch.nn.modules._functions", "SyncBatchNorm"),
    ("torch.nn.modules.batchnorm", "_BatchNorm"),
    ("torch.nn.modules.batchnorm", "_BatchNorm._check_input_dim"),
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout"),
    ("atexit", "_run_exitfuncs"),
    ("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector.dump_checkpoint"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher.get_extra_results"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher.update_main_process_results"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher._wrapping_function"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher._call_children_scripts"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher._check_can_spawn_children"),
    ("lightning.fabric.strategies.launchers.subprocess_script", "_basic_subprocess_cmd"),
    ("lightning.fabric.strategies.launchers.subprocess_script", "_hydra_subprocess_cmd"),
    ("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed"),
    ("lightning.pytorch.utilities.data", "_update_dataloader"),
    ("lightning.pytorch.strategies.ddp", "DDPStrategy._configure_launcher"),
    ("lightning.pytorch.strategies.ddp", "DDPStrategy._register_ddp_hooks"),
    ("lightning.pytorch.strategies.ddp", "DDPStrategy._get_process_group_backend"),
    ("lightning.pytorch.trainer.connectors.data_connector", "_DataLoaderSource.dataloader"),
    ("lightning.pytorch.trainer.connectors.logger_connector.logger_connector", "_LoggerConnector.should_reset_tensors"),
    ("lightning.pytorch.loggers.csv_logs", "ExperimentWriter._check_log_dir_exists"),
    ("lightning.pytorch.loggers.csv_logs", "ExperimentWriter._rewrite_with_new_header"),
    ("hydra._internal.core_plugins.basic_sweeper", "BasicSweeper.split_arguments"),
    ("hydra._internal.hydra", "Hydra.create_main_hydra2"),
    ("hydra._internal.utils", "create_config_search_path"),
)

# (module, class, attributes): private attributes that instances of the class have after
# construction, which the pack reads or sets (on instances of its subclasses too).
CHECKED_ATTRIBUTES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "lightning.pytorch.strategies.ddp",
        "DDPStrategy",
        (
            *"_checkpoint_io _ddp_comm_hook _ddp_comm_state _ddp_comm_wrapper _launcher _layer_sync".split(),
            *"_lightning_module _start_method".split(),
        ),
    ),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher", ("_start_method",)),
    ("lightning.pytorch.loggers.csv_logs", "CSVLogger", ("_experiment", "_fs")),
    ("lightning.pytorch.loggers.tensorboard", "TensorBoardLogger", ("_experiment", "_kwargs")),
    ("lightning.pytorch.utilities.combined_loader", "CombinedLoader", ("_mode",)),
    ("lightning.pytorch.loops.evaluation_loop", "_EvaluationLoop", ("_data_source",)),
    ("lightning.pytorch.loops.prediction_loop", "_PredictionLoop", ("_data_source",)),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop", ("_batches_that_stepped", "_results")),
    ("lightning.pytorch.trainer.trainer", "Trainer", ("_checkpoint_connector", "_logger_connector", "_results")),
    ("lightning.pytorch.core.module", "LightningModule", ("_compiler_ctx",)),
)

# Lightning's result collection (``lightning.pytorch.trainer.connectors.logger_connector.result``), where
# ``self.log``'s values live, reached through ``Trainer._results`` and the training epoch loop's ``_results``:
# each member the pack reads, calls or sets, by class (the accessors below, and lightning/epoch_partials.py
# and lightning/reproducible.py on the entries they return), and the parameters of the calls it makes.
# tests/test_compat.py checks them on a collection built as Lightning builds it.
RESULT_MEMBERS: dict[str, tuple[str, ...]] = {
    "_ResultCollection": ("batch_size", "items", "pop", "update", "reset", "update_metrics"),
    "_ResultMetric": ("is_tensor", "value", "cumulated_batch_size", "meta", "reset"),
    "_Metadata": (
        *"fx name on_epoch reduce_fx sync metric_attribute".split(),
        *"is_mean_reduction is_sum_reduction is_max_reduction is_min_reduction".split(),
    ),
    "_Sync": ("should",),
}
RESULT_CALLS: dict[str, tuple[str, ...]] = {
    "_ResultCollection.update_metrics": ("key", "value", "batch_size"),
    "_ResultCollection.reset": ("metrics", "fx"),
}

# Lightning's private launchers, imported when first asked for (as `_compat.<name>`, without the underscore)
_LAZY = {
    "MultiProcessingLauncher": "lightning.pytorch.strategies.launchers.multiprocessing",
    "SubprocessScriptLauncher": "lightning.pytorch.strategies.launchers.subprocess_script",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), f"_{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint dict ``Trainer.save_checkpoint`` would write, without writing it or gathering
    anything across ranks (``trainer._checkpoint_connector.dump_checkpoint``): Lightning has no public
    way to build it alone."""
    return cast("dict[str, Any]", trainer._checkpoint_connector.dump_checkpoint(weights_only=False))


def run_exit_functions() -> None:
    """Run the ``atexit`` handlers now (``atexit._run_exitfuncs``, CPython's, as the interpreter does at
    exit): a process that leaves with ``os._exit`` runs them first. Python has no public way to."""
    atexit._run_exitfuncs()


def default_store() -> Any:
    """The default process group's store (``torch.distributed.distributed_c10d._get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def set_group_timeout(seconds: float) -> None:
    """Set the default process group's collective timeout (``distributed_c10d._set_pg_timeout``):
    torch has no public way to change it once the group is made."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds))


def subprocess_cmd(local_rank: int) -> tuple[list[str], str | None]:
    """Lightning's command and working folder for child rank ``local_rank``, chosen as its launcher
    does: the Hydra job's inside a Hydra job, else the current script's."""
    from hydra.core.hydra_config import HydraConfig
    from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd, _hydra_subprocess_cmd

    if HydraConfig.initialized():
        command, cwd = _hydra_subprocess_cmd(local_rank)
        return list(command), cwd
    return list(_basic_subprocess_cmd()), None


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's default of ``OMP_NUM_THREADS`` per process when several share a machine."""
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    _set_num_threads_if_needed(num_processes=num_processes)


def update_dataloader(dataloader: Any, sampler: Any) -> Any:
    """``dataloader`` rebuilt with ``sampler`` (every other argument kept), as Lightning does it.

    Example::

        >>> from torch.utils.data import DataLoader, SequentialSampler
        >>> data = list(range(10))
        >>> loader = update_dataloader(DataLoader(data, batch_size=4), SequentialSampler(data[:6]))
        >>> loader.batch_size, [batch.tolist() for batch in loader]
        (4, [[0, 1, 2, 3], [4, 5]])
    """
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler)


def loop_data_source(loop: Any) -> Any:
    """The object an evaluation or prediction loop asks for its dataloaders (``.dataloader()``): the one
    place where a sampler can be swapped before Lightning injects its own (docs/design.md)."""
    return loop._data_source


def logger_step(trainer: Any) -> int:
    """The step Lightning's logger connector (and ``LearningRateMonitor``) logs the current batch at;
    ``trainer.global_step`` differs in manual optimization and after an accumulation window."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def training_epoch_results(trainer: Any) -> Any:
    """The training loop's running epoch aggregation of what ``self.log`` gave: ``"<hook>.<name>"`` to
    Lightning's ``_ResultMetric`` (``.meta``, ``.is_tensor``, ``.value``, ``.cumulated_batch_size``); no
    public API reads or restores it (why it is needed: lightning/epoch_partials.py)."""
    return trainer.fit_loop.epoch_loop._results


def add_to_epoch_sum(entry: Any, value: Any, count: Any | None) -> None:
    """Add a saved running sum (and row count, for a mean) to a ``_ResultMetric`` of the running
    epoch. Its torchmetrics ``merge_state`` would do it, but Lightning leaves ``full_state_update``
    unset, which that method refuses; these two states are exactly what ``update`` accumulates."""
    entry.value = entry.value + value.to(entry.value)
    if count is not None:
        entry.cumulated_batch_size = entry.cumulated_batch_size + count.to(entry.cumulated_batch_size)


def combined_loader_mode(combined: Any) -> str:
    """The mode of a ``CombinedLoader`` ("sequential", "max_size_cycle", ...).

    Example::

        >>> from lightning.pytorch.utilities import CombinedLoader
        >>> combined_loader_mode(CombinedLoader([[1, 2], [3]], mode="sequential"))
        'sequential'
    """
    return str(combined._mode)


def compiled_by_lightning(module: Any) -> bool:
    """Whether Lightning unwrapped ``module`` from ``torch.compile(module)`` (``from_compiled`` keeps
    the original step methods in ``module._compiler_ctx``; ``to_uncompiled`` clears it): no public
    attribute tells.

    Example::

        >>> from lightning.pytorch import LightningModule
        >>> compiled_by_lightning(LightningModule())
        False
    """
    return getattr(module, "_compiler_ctx", None) is not None


def hydra_sweep_batches(overrides: list[Any]) -> list[list[list[str]]]:
    """Hydra's basic sweeper's expansion of parsed overrides: one batch, a list of jobs' overrides.

    Example::

        >>> from hydra.core.override_parser.overrides_parser import OverridesParser
        >>> hydra_sweep_batches(OverridesParser.create().parse_overrides(["a=1,2", "b=x"]))
        [[['a=1', 'b=x'], ['a=2', 'b=x']]]
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return BasicSweeper.split_arguments(overrides, None)


def hydra_config_search_path(primary: str) -> ConfigSearchPath:
    """The config search path Hydra's own command line builds around the primary config location.

    Example::

        >>> [element.path for element in hydra_config_search_path("pkg://ddp_plugins.conf").get_path()][:2]
        ['pkg://hydra.conf', 'pkg://ddp_plugins.conf']
    """
    from hydra._internal.utils import create_config_search_path

    return create_config_search_path(primary)


def hydra_create_main(task_name: str, search_path: ConfigSearchPath) -> None:
    """Initialize the global Hydra (what ``hydra.initialize`` does) from a full search path."""
    from hydra._internal.hydra import Hydra

    Hydra.create_main_hydra2(task_name=task_name, config_search_path=search_path)


def strategy_comm_hook(strategy: Any) -> Any:
    """The communication hook a ``DDPStrategy`` was given (``None``: DDP's default all-reduce)."""
    return strategy._ddp_comm_hook


def strategy_comm_state_and_wrapper(strategy: Any) -> tuple[Any, Any]:
    """The hook state and hook wrapper a ``DDPStrategy`` was given."""
    return strategy._ddp_comm_state, strategy._ddp_comm_wrapper


def running_results(trainer: Any, hook: str) -> Any:
    """What ``self.log`` collected in the running loop (``trainer._results``), reset for ``hook`` first where
    Lightning would (``_logger_connector.should_reset_tensors``), so entries read before the user's step stay
    valid after it. No public way adjusts a logged value: the strategy takes an empty micro-batch's NaN mean
    back, and the reproducible mode each shard's values out."""
    results = trainer._results
    if trainer._logger_connector.should_reset_tensors(hook):
        results.reset(metrics=False, fx=hook)
    return results


def set_aside(results: Any, hook: str, synced_only: bool = False) -> dict[str, Any]:
    """Take ``hook``'s tensor entries (those logged with ``sync_dist=True``) out of ``results``;
    ``results.update(...)`` puts them back."""
    keys = [
        key for key, entry in results.items()
        if entry.is_tensor and entry.meta.fx.split(".")[0] == hook and (entry.meta.sync.should or not synced_only)
    ]  # fmt: skip
    return {key: results.pop(key) for key in keys}


def logged_value(entry: Any) -> Any:
    """A tensor entry's value as its ``compute`` gives it, without the sync (the mean over the batch sizes logged)."""
    if entry.meta.on_epoch and entry.meta.is_mean_reduction:
        return entry.value / entry.cumulated_batch_size
    return entry.value


def epoch_sums(results: Any) -> dict[str, tuple[Any, Any]]:
    """Each tensor entry's running epoch value and batch-size sum (``None`` but for a mean)."""
    return {k: (e.value, getattr(e, "cumulated_batch_size", None)) for k, e in results.items() if e.is_tensor}


def restore_epoch_sums(results: Any, sums: dict[str, tuple[Any, Any]]) -> None:
    """Give every tensor entry its ``sums`` back (an entry made since gets its empty state): Lightning's
    epoch mean adds ``value * batch_size``, so an empty micro-batch's NaN mean would stay at batch size 0."""
    for key, entry in results.items():
        if not entry.is_tensor:
            continue
        meta, value = entry.meta, entry.value
        empty = -math.inf if meta.is_max_reduction else math.inf if meta.is_min_reduction else 0.0
        before, count = sums.get(key, (torch.full_like(value, empty), torch.zeros_like(value, dtype=torch.long)))
        entry.value = before.to(value)  # in the dtype the step's value made it (float64 for a float64 loss)
        if meta.is_mean_reduction:
            entry.cumulated_batch_size = count
