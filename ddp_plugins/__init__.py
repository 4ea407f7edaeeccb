"""ddp_plugins: PyTorch Lightning plugins that make DDP training equal single-process math.

Three layers; imports only point down, and ``import ddp_plugins`` (or ``ddp_plugins.core``)
does not import Lightning: the adapter names below load it on first use.

Module map
----------
``ddp_plugins.core`` (plain torch, usable from a raw DDP loop or Fabric)
    ``checks``                   argument validators: one exception policy (TypeError / ValueError)
    ``ranks``                    get_rank, get_world_size, rank_zero_first, setup_rank_logging
    ``process``                  run_main / exit_process (the clean exit), save_atomic
    ``collectives``              distributed_concat and its row helpers
    ``samplers``                 SequentialDistributedSampler, ResumableSampler (exact mid-epoch resume)
    ``plan``                     GlobalPlan, PlanBatchSampler (exact epochs), EvenSteps (uneven shards)
    ``preemption``               signal flags, agreement at a step boundary, Preempted, Slurm requeue
    ``checkpoints``              per-rank state gathered at save, the latest checkpoint, metrics rows
    ``sync_batchnorm_function``  the SyncBN autograd function (one all_reduce forward, one backward)
    ``sync_batchnorm``           SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
    ``comm_hooks``               build_comm_hook, CountingCommHook, count_collectives
    ``seeding``                  seed_everything_rank_aware, RNG state collection
``ddp_plugins.lightning`` (adapters: one concept of the core wired into a Trainer)
    ``sync_batchnorm`` / ``layer_sync``  SyncBatchNormCallback / SyncBatchNormPlugin
    ``accumulation``             AccumulationNoSync
    ``allreduce_counter``        AllReduceCounter
    ``sequential_evaluation``    SequentialEvaluation
    ``rank_aware_seed``          RankAwareSeed
    ``preemption``               PreemptionCheckpoint (stop on a signal at one step, step checkpoints)
    ``checkpoint_io``            AtomicCheckpointIO (a checkpoint file is whole or absent)
    ``csv_logger``               ResumableCSVLogger (a resumed run continues metrics.csv)
    ``strategy``                 DDPPluginsStrategy (backend, timeout, comm hooks, DDP options, data plan)
    ``data_plan``                the global plan in the training loader, resumes checked against it
    ``launchers``                child-rank launchers (job-scoped commands, rank watcher, clean exit)
    ``network``                  network presets into the environment, gloo on loopback
``ddp_plugins.app`` (the training app)
    ``train``                    Hydra entry point (``python -m ddp_plugins.train``, ``ddp_plugins/train.py``)
    ``checks``                   the up-front check: compose, build every configured object, one-line errors
    ``demo``                     DigitsCNN, DigitsDataModule, SyntheticDataModule
``ddp_plugins._compat``          every private Lightning/torch name, with the versions checked

From the command line to the DDP call
-------------------------------------
``python -m ddp_plugins.train backend=gloo strategy.comm_hook=fp16 trainer.devices=2``:

1. ``app.train.main`` -> ``app.checks.precheck`` composes ``conf/train.yaml`` with the overrides
   (every sweep job under ``-m``), builds the strategy, callbacks, model, datamodule and Trainer
   without starting anything, so each class's own validator (``core.checks``) runs; a bad value
   ends here with ``error: <key> ..., allowed: ...`` and exit code 2.
2. Hydra creates the run folder and calls ``app.train.train``: network preset
   (``lightning.network.apply_network_env``), seed, ``hydra.utils.instantiate`` of
   ``conf/strategy/ddp.yaml`` -> ``lightning.strategy.DDPPluginsStrategy(backend="gloo",
   comm_hook="fp16")``, then ``Trainer.fit``.
3. ``lightning.launchers._JobSubprocessLauncher`` starts the child ranks (this job's overrides);
   every rank runs ``DDPPluginsStrategy.setup_distributed`` (gloo pinned to loopback),
   ``configure_ddp`` -> ``DistributedDataParallel(...)`` and ``register_comm_hook`` with
   ``core.comm_hooks.build_comm_hook("fp16")``; the callbacks (``conf/callbacks/``) convert
   SyncBN, skip all-reduces in accumulation, count them, gather exact metrics, seed per rank.
4. Every process leaves through ``core.process.exit_process`` (no gloo abort at exit).

Example::

    >>> import ddp_plugins
    >>> ddp_plugins.__version__
    '0.3.0'
    >>> ddp_plugins.get_world_size()  # no process group: a single process
    1
    >>> ddp_plugins.SyncBatchNormCallback.__module__  # an adapter, loaded on first access
    'ddp_plugins.lightning.sync_batchnorm'
"""

from __future__ import annotations

import importlib
from typing import Any

from ddp_plugins.core import (
    CountingCommHook,
    SequentialDistributedSampler,
    SyncBatchNorm,
    build_comm_hook,
    convert_sync_batchnorm,
    count_collectives,
    distributed_concat,
    exit_process,
    get_rank,
    get_world_size,
    rank_zero_first,
    revert_sync_batchnorm,
    run_main,
    save_atomic,
    seed_everything_rank_aware,
    setup_rank_logging,
)

__version__ = "0.3.0"

# Adapter names, loaded (with Lightning) on first access.
_ADAPTERS = {
    "AccumulationNoSync": "ddp_plugins.lightning.accumulation",
    "AllReduceCounter": "ddp_plugins.lightning.allreduce_counter",
    "DDPPluginsStrategy": "ddp_plugins.lightning.strategy",
    "PreemptionCheckpoint": "ddp_plugins.lightning.preemption",
    "RankAwareSeed": "ddp_plugins.lightning.rank_aware_seed",
    "SequentialEvaluation": "ddp_plugins.lightning.sequential_evaluation",
    "SyncBatchNormCallback": "ddp_plugins.lightning.sync_batchnorm",
    "SyncBatchNormPlugin": "ddp_plugins.lightning.layer_sync",
    "apply_network_env": "ddp_plugins.lightning.network",
}

__all__ = [
    "AccumulationNoSync",
    "AllReduceCounter",
    "CountingCommHook",
    "DDPPluginsStrategy",
    "PreemptionCheckpoint",
    "RankAwareSeed",
    "SequentialDistributedSampler",
    "SequentialEvaluation",
    "SyncBatchNorm",
    "SyncBatchNormCallback",
    "SyncBatchNormPlugin",
    "apply_network_env",
    "build_comm_hook",
    "convert_sync_batchnorm",
    "count_collectives",
    "distributed_concat",
    "exit_process",
    "get_rank",
    "get_world_size",
    "rank_zero_first",
    "revert_sync_batchnorm",
    "run_main",
    "save_atomic",
    "seed_everything_rank_aware",
    "setup_rank_logging",
]


def __getattr__(name: str) -> Any:
    if name in _ADAPTERS:
        value = getattr(importlib.import_module(_ADAPTERS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ADAPTERS))
