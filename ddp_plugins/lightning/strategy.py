""":class:`DDPPluginsStrategy`, registered as ``ddp_plugins``, ``ddp_plugins_spawn`` and ``ddp_plugins_notebook``.

Rationale in docs/design.md ("When a rank fails or stops", "Which interfaces listen (one node)")."""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from ddp_plugins import _compat
from ddp_plugins.core.checkpoints import gather_per_rank
from ddp_plugins.core.checks import ArgumentValueError, check_bool, check_choice, check_int, check_number
from ddp_plugins.core.comm_hooks import build_comm_hook, check_comm_hook
from ddp_plugins.core.liveness import Liveness, rendezvous_error
from ddp_plugins.core.preemption import restart_scoped_store
from ddp_plugins.core.process import start_forkserver
from ddp_plugins.core.ranks import for_collective
from ddp_plugins.core.samplers import loader_seed
from ddp_plugins.core.workers import WorkerInit
from ddp_plugins.lightning import traps
from ddp_plugins.lightning.checkpoint_io import AtomicCheckpointIO
from ddp_plugins.lightning.data_plan import (
    CHECKPOINT_KEY,
    BatchRows,
    PlannedLoader,
    PlannedSteps,
    ResumeRecord,
    UnevenShards,
    check_global_batch,
    is_mean,
    run_accumulation,
    train_loader,
)
from ddp_plugins.lightning.launchers import CleanExitMultiprocessingLauncher, JobSubprocessLauncher
from ddp_plugins.lightning.layer_sync import SyncBatchNormPlugin
from ddp_plugins.lightning.network import is_loopback, pin_gloo_to_loopback
from ddp_plugins.lightning.reproducible import FINGERPRINT_KEY, ReproducibleSteps, state_fingerprint

__all__ = ["BACKENDS", "DDPPluginsStrategy", "check_backend"]

BACKENDS = ("auto", "gloo", "nccl", "mpi")
_StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
_START_METHODS: tuple[_StartMethod, ...] = ("popen", "spawn", "fork", "forkserver")


def check_backend(backend: Any, accelerator: str = "auto") -> None:
    """Check that ``backend`` names a process-group backend this machine can run.

    Raises:
        ArgumentValueError: an unknown name, ``nccl`` without CUDA, ``mpi`` without an MPI-enabled torch.

    Example::

        >>> check_backend("foo")
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `backend` should be one of 'auto', 'gloo', 'nccl', 'mpi', got 'foo'.
    """
    check_choice("backend", backend, BACKENDS)
    problem, hint = None, ""
    if backend == "nccl":
        cuda = torch.cuda.is_available()
        if not cuda or accelerator == "cpu":
            problem = f"got 'nccl' without CUDA GPUs (cuda available: {cuda}, accelerator: {accelerator!r})"
        elif not dist.is_nccl_available():
            problem = "got 'nccl' with a torch built without NCCL"
    elif backend == "mpi" and not dist.is_mpi_available():
        problem = (
            f"got 'mpi' with a torch built without MPI ({torch.__version__};"
            " torch.distributed.is_mpi_available() is False)"
        )
        hint = "Use backend=gloo, or build torch from source against your MPI."
    if problem is not None:
        allowed = "'auto' or 'gloo' (or a backend this machine can run)"
        raise ArgumentValueError("backend", allowed, problem=problem, hint=hint)


def _registered_elsewhere(process_group_backend: Any) -> bool:
    """A ``process_group_backend`` torch knows besides ours (ucc, xccl, or one a plugin registered,
    such as oneCCL's ccl or Ascend's hccl): passed to ``init_process_group`` as ``DDPStrategy`` does."""
    known = getattr(dist.Backend, "backend_list", [])
    return (
        isinstance(process_group_backend, str)
        and process_group_backend not in BACKENDS
        and process_group_backend.lower() in known
    )


def _check_world_size(environment: Any, num_processes: int, num_nodes: int) -> None:
    """Lightning's message, before a bare ``IndexError``, when the launcher started more ranks than asked."""
    if not environment.creates_processes_externally:
        return
    expected = num_processes * num_nodes
    world_size = environment.world_size()
    if world_size != expected:
        raise ArgumentValueError(
            "devices",
            f"devices x num_nodes = the world size the launcher started ({world_size})",
            problem=f"got devices={num_processes} x num_nodes={num_nodes} = {expected}",
            hint=(
                "Match `Trainer(devices=..., num_nodes=...)` to torchrun's --nproc-per-node/--nnodes or Slurm's tasks."
            ),
        )


class DDPPluginsStrategy(DDPStrategy):
    """Lightning's DDP strategy with hooks by name on every backend, timeouts in seconds, no hangs.

    Args:
        backend: ``"auto"`` (nccl on CUDA, gloo otherwise), ``"gloo"``, ``"nccl"`` or ``"mpi"``;
            ``process_group_backend=`` (``DDPStrategy``'s name) is the same argument.
        timeout: timeout of collectives (and of the rendezvous, unless ``rendezvous_timeout`` is
            given), in seconds or a ``timedelta``.
        rendezvous_timeout: how long the ranks wait for each other at start-up (``None``:
            ``timeout``); longer where ranks start far apart, ``timeout`` applying once they met.
        start_method: ``"popen"`` (children re-run the script), ``"spawn"``, ``"fork"``
            (notebooks) or ``"forkserver"``.
        comm_hook: ``"none"``, ``"fp16"``, ``"bf16"`` (nccl 2.10+ only) or ``"powersgd"``;
            a hook given as ``ddp_comm_hook=callable`` needs ``comm_hook="none"``.
        powersgd_rank: PowerSGD's matrix approximation rank.
        powersgd_start_iter: the iteration from which PowerSGD compresses (plain all-reduce before).
        bucket_cap_mb: DDP's gradient bucket size in MiB (``None``: torch's default, 25).
        find_unused_parameters: let DDP find parameters that got no gradient.
        static_graph: tell DDP the graph is the same every iteration.
        gradient_as_bucket_view: gradients are views into DDP's buckets (saves a copy).
        global_batch_size: rows per optimizer step of one global plan per epoch, on any number of
            ranks, losses weighted by rows (:mod:`ddp_plugins.core.plan`); ``None``: Lightning's
            ``DistributedSampler``.
        drop_last: with ``global_batch_size``, leave out each epoch's short last step.
        uneven_data: ranks whose loaders yield different numbers of batches step together until
            the longest ends, with rows weighted (:class:`~ddp_plugins.core.plan.EvenSteps`).
        stall_name_after: seconds without progress after which a stalled rank is named in one line,
            with every rank's stack (:class:`~ddp_plugins.core.liveness.Liveness`); ``None``: off.
        stall_end_after: seconds after which a stall ends the job, with a rescue checkpoint
            (``None``: named only); a failed collective ends it at once.
        child_command: ``local_rank -> (command, working folder)`` of each child rank under
            ``start_method="popen"`` (default: Lightning's; the app re-runs only the Hydra job).
        reproducible: with ``global_batch_size``, the same bits on 1 to ``virtual_shards`` ranks
            (:mod:`ddp_plugins.core.reproducible`; limits in docs/design.md).
        virtual_shards: the reproducible mode's shards per step (the same for runs to compare).
        **kwargs: passed to Lightning's ``DDPStrategy`` and from there to
            ``DistributedDataParallel``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an unknown backend, start method or hook, a backend this machine cannot run,
            ``bf16`` on a backend without it, a ``rendezvous_timeout`` of its own on a backend other than
            gloo or nccl, or a number out of range.

    Example::

        >>> DDPPluginsStrategy(backend="gloo", timeout=60).process_group_backend
        'gloo'
    """

    strategy_name = "ddp_plugins"
    __layer_sync: LayerSync | None

    def __init__(
        self,
        backend: str = "auto",
        timeout: float | timedelta = 1800.0,
        rendezvous_timeout: float | timedelta | None = None,
        start_method: str = "popen",
        comm_hook: str = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 1000,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        global_batch_size: int | None = None,
        drop_last: bool = False,
        uneven_data: bool = True,
        stall_name_after: float | None = 30.0,
        stall_end_after: float | None = 300.0,
        child_command: Callable[[int], tuple[list[str], str | None]] | None = None,
        reproducible: bool = False,
        virtual_shards: int = 8,
        **kwargs: Any,
    ) -> None:
        process_group_backend = kwargs.pop("process_group_backend", None)
        if process_group_backend is not None:  # Lightning's name for `backend`
            if backend not in ("auto", process_group_backend):
                raise ArgumentValueError(
                    "process_group_backend", f"the same as `backend` ({backend!r}) or left out", process_group_backend
                )
            backend = process_group_backend
        if not _registered_elsewhere(process_group_backend):
            check_backend(backend, str(kwargs.get("accelerator") or "auto"))
        check_choice("start_method", start_method, _START_METHODS)
        if isinstance(timeout, timedelta):  # Lightning's own type for it
            timeout = timeout.total_seconds()
        check_number("timeout", timeout, 0, exclusive_minimum=True, what="seconds (or a datetime.timedelta)")
        if isinstance(rendezvous_timeout, timedelta):
            rendezvous_timeout = rendezvous_timeout.total_seconds()
        check_number(
            "rendezvous_timeout", rendezvous_timeout, 0, exclusive_minimum=True, allow_none=True,
            what="seconds (or a datetime.timedelta)",
        )  # fmt: skip
        if rendezvous_timeout not in (None, timeout) and backend not in ("auto", "gloo", "nccl"):
            raise ArgumentValueError(
                "rendezvous_timeout",
                "None or `timeout` on this backend",
                rendezvous_timeout,
                hint=f"torch changes a {backend!r} group's timeout only when it is made; gloo and nccl take both.",
            )
        check_comm_hook(comm_hook, backend if backend in ("gloo", "mpi") else None)
        check_int("powersgd_rank", powersgd_rank, 1)
        check_int("powersgd_start_iter", powersgd_start_iter, 2)
        check_number("bucket_cap_mb", bucket_cap_mb, 0, exclusive_minimum=True, what="MiB", allow_none=True)
        ddp_kwargs: dict[str, Any] = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
        }
        for name, value in ddp_kwargs.items():
            check_bool(name, value)
        check_int("global_batch_size", global_batch_size, 1, allow_none=True)
        check_bool("drop_last", drop_last)
        check_number("stall_name_after", stall_name_after, 0, exclusive_minimum=True, what="seconds", allow_none=True)
        check_number("stall_end_after", stall_end_after, stall_name_after or 0, what="seconds", allow_none=True)
        check_bool("uneven_data", uneven_data)
        check_bool("reproducible", reproducible)
        check_int("virtual_shards", virtual_shards, 1)
        bypassed = {"comm_hook": comm_hook, "ddp_comm_hook": kwargs.get("ddp_comm_hook")}
        bypassed["find_unused_parameters"] = find_unused_parameters
        self._steps = (
            ReproducibleSteps(virtual_shards, global_batch_size, **bypassed) if reproducible else PlannedSteps()
        )
        if comm_hook != "none" and kwargs.get("ddp_comm_hook") is not None:
            raise ArgumentValueError(
                "comm_hook",
                "'none' when `ddp_comm_hook` is given",
                comm_hook,
                hint="Give one: a name in `comm_hook`, or a callable in `ddp_comm_hook`.",
            )
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(
            process_group_backend=None if backend == "auto" else backend,
            timeout=timedelta(seconds=timeout),
            start_method=cast(_StartMethod, start_method),  # checked against _START_METHODS above
            **ddp_kwargs,
            **kwargs,
        )
        self._backend = backend
        self._child_command = child_command
        self._stall = (stall_name_after, stall_end_after)
        self._room: Liveness | None = None
        self._timeout_s = float(timeout)
        self._rendezvous_s = float(timeout if rendezvous_timeout is None else rendezvous_timeout)
        self._env_set: list[str] = []
        self._env_rewritten: dict[str, str] = {}  # what this strategy changed in the environment: the user's values
        self.last_checkpoint_path: str | None = None  # the file the last save_checkpoint wrote (rank 0)
        self._comm_hook = comm_hook
        self._powersgd_rank = powersgd_rank
        self._powersgd_start_iter = powersgd_start_iter
        self.global_batch_size = global_batch_size
        self._planned = PlannedLoader(global_batch_size, drop_last, self._steps.virtual_shards)
        self._uneven = UnevenShards(uneven_data, flag=self._raised_flag)  # shards in step, flags in their round
        self._resume = ResumeRecord()  # the data layout checkpoints keep, and where a resume starts
        self._flag_sources: list[Callable[[], int]] = []
        self._rows: BatchRows | None = None  # the current micro-batch's (planned or uneven training)
        if comm_hook != "none":
            # set now so that callbacks (AllReduceCounter) can wrap it in `setup`; the state is
            # built per fit in `configure_ddp`
            self._ddp_comm_hook = build_comm_hook(comm_hook)[1]

    @property
    def checkpoint_io(self) -> Any:
        # Lazily, as Lightning's default: a CheckpointIO given in `Trainer(plugins=...)` still wins.
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()  # a checkpoint file is whole or absent
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    @property
    def comm_hook(self) -> str:
        """The communication hook's name (``"none"`` when a callable was given or none at all)."""
        return self._comm_hook

    @property
    def virtual_shards(self) -> int | None:
        """The shards of each step in the reproducible mode (contracts.ShardsEachStep), else ``None``."""
        return self._steps.virtual_shards

    @property
    def _layer_sync(self) -> LayerSync | None:
        return self.__layer_sync

    @_layer_sync.setter
    def _layer_sync(self, plugin: LayerSync | None) -> None:
        # torch's TorchSyncBatchNorm (`sync_batchnorm=True`'s) runs on accelerators only: its device-agnostic
        # drop-in takes its place. A subclass of it is kept, for whoever wants torch's own class.
        plugin = SyncBatchNormPlugin() if type(plugin) is TorchSyncBatchNorm else plugin
        self.__layer_sync = self._steps.layer_sync(plugin)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Lightning calls this once accelerator and devices are known, before any process starts;
        # the world size first: the backend check reads the device at this process's local rank
        _check_world_size(self.cluster_environment, self.num_processes, self.num_nodes)
        self._check_one_gpu_per_nccl_rank()
        if self.accelerator is not None and self.parallel_devices:
            check_comm_hook(self._comm_hook, self._get_process_group_backend())
        check = self._check_before_launch
        if self._start_method == "popen":
            env, processes, nodes = self.cluster_environment, self.num_processes, self.num_nodes
            self._launcher = JobSubprocessLauncher(
                env, processes, nodes, before_launch=check, child_command=self._child_command,
                watch_after_startup=self._stall[0] is None,  # else the liveness room names a failed rank
                on_failure=self._failed,
            )  # fmt: skip
        else:
            self._launcher = CleanExitMultiprocessingLauncher(
                self, start_method=self._start_method, before_launch=check
            )

    def _ranks_per_gpu(self) -> int:
        """This host's ranks per GPU (0 off CUDA); every rank is this host's on a loopback main address."""
        if self.root_device.type != "cuda":
            return 0
        environment, gpus = self.cluster_environment, torch.cuda.device_count()
        if gpus == 0:  # CUDA not visible to this process: nothing to tell
            return 1
        loopback = environment is not None and is_loopback(environment.main_address)
        return math.ceil(self.num_processes * (self.num_nodes if loopback else 1) / gpus)

    def _check_one_gpu_per_nccl_rank(self) -> None:
        """nccl cannot run two ranks on one GPU (NCCL's "invalid usage"): refused before any group is made."""
        if self._backend == "nccl" and self._ranks_per_gpu() > 1:
            raise ArgumentValueError(
                "backend",
                "'gloo' or 'auto' when ranks share a GPU",
                problem=(
                    f"got 'nccl' with {self._ranks_per_gpu()} ranks on each of this machine's"
                    f" {torch.cuda.device_count()} GPU(s); nccl needs a GPU per rank"
                ),
                hint="Use backend=auto (gloo with CUDA tensors here), or as many ranks per machine as GPUs.",
            )

    @override
    def _get_process_group_backend(self) -> str:
        backend = super()._get_process_group_backend()
        if self._backend == "auto" and backend == "nccl" and self._ranks_per_gpu() > 1:
            return "gloo"  # auto: nccl only when every rank has a GPU of its own; gloo takes CUDA tensors
        return backend

    def _check_before_launch(self, trainer: Any) -> None:
        """What needs the Trainer's callbacks, checked in the launching process before any rank starts."""
        if self.global_batch_size is not None:
            world_size = self.num_processes * self.num_nodes
            check_global_batch(self.global_batch_size, world_size, run_accumulation(trainer))
            self._steps.before_launch(trainer, world_size)

    @override
    def setup_distributed(self) -> None:
        backend = self._get_process_group_backend()
        check_comm_hook(self._comm_hook, backend)
        if backend == "gloo":
            if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
                # torch 2.13: DistributedDataParallel(...) segfaults in its construction logging when the
                # debug level is DETAIL on gloo (even a bare nn.Linear); INFO keeps the other debug checks
                rank_zero_warn(
                    "TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DistributedDataParallel on gloo with this torch"
                    f" ({torch.__version__}, a segfault while DDP is built); using INFO instead."
                )
                self._env_rewritten.setdefault("TORCH_DISTRIBUTED_DEBUG", os.environ["TORCH_DISTRIBUTED_DEBUG"])
                os.environ["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
                dist.set_debug_level(dist.DebugLevel.INFO)
            assert self.cluster_environment is not None
            if pin_gloo_to_loopback(self.cluster_environment.main_address):
                self._env_set.append("GLOO_SOCKET_IFNAME")  # removed again in teardown
        try:
            self._make_process_group()
        except (dist.DistStoreError, dist.DistNetworkError) as err:
            assert self.cluster_environment is not None
            env = self.cluster_environment
            raise rendezvous_error(err, env.main_address, env.main_port, self.world_size, self._rendezvous_s) from None
        if self._rendezvous_s != self._timeout_s:  # the ranks have met: collectives get their own timeout
            _compat.set_group_timeout(self._timeout_s)
        name_after, end_after = self._stall
        if name_after is not None and self.world_size > 1:
            self._room = Liveness(
                _compat.default_store(), self.global_rank, self.world_size, name_after, end_after,
                rescue=self._save_last_completed_step,
                folder=lambda: getattr(self._trainer(), "default_root_dir", None),  # the run's folder
            ).start()  # fmt: skip

    def _save_last_completed_step(self) -> str | None:
        """The liveness room's rescue, on the rank that ends a stalled job while its training thread waits
        in (or saw fail) a collective: ``step-<N>-stalled.ckpt`` beside the run's others, with the last
        completed step's parameters and optimizer state; the loops resume at the next batch. The stalled
        ranks' random states cannot be gathered (:class:`RankAwareSeed` says so on resume)."""
        trainer = self._trainer()
        if trainer is None or not trainer.training:
            return None
        dirpath = next((c.dirpath for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)), None)
        folder = Path(dirpath or Path(trainer.default_root_dir) / "checkpoints")
        checkpoint = _compat.dump_checkpoint(trainer)
        self._add_records(checkpoint)
        path = folder / f"step-{trainer.global_step}-stalled.ckpt"
        self.checkpoint_io.save_checkpoint(checkpoint, path)
        return str(path)

    def _trainer(self) -> Any:
        try:
            return self.lightning_module.trainer if self.lightning_module is not None else None
        except RuntimeError:  # not attached to a Trainer
            return None

    def _make_process_group(self) -> None:
        """Make the process group with the rendezvous timeout (Lightning's ``_init_dist_connection`` then
        finds it made); under torchrun on this restart round's keys (see ``restart_scoped_store``)."""
        if not dist.is_initialized():
            self.set_world_ranks()
            rank, size, env = self.global_rank, self.world_size, self.cluster_environment
            assert env is not None
            store = restart_scoped_store(timedelta(seconds=self._rendezvous_s))
            if store is None:  # where Lightning's env:// rendezvous looks
                os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.main_address, str(env.main_port)
            logging.getLogger("lightning.fabric.utilities.distributed").info(  # Lightning's own line
                f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{size}"
            )
            dist.init_process_group(
                self._get_process_group_backend(),
                store=store,
                rank=rank,
                world_size=size,
                timeout=timedelta(seconds=self._rendezvous_s),
                device_id=self.root_device if self.root_device.type != "cpu" else None,
            )
        super().setup_distributed()

    @override
    def setup(self, trainer: Any) -> None:
        traps.warn_compiled_module(self.lightning_module)  # before dynamo fails in `self.log`
        super().setup(trainer)
        traps.check_static_graph(trainer)  # DDP wrapped the model; before torch's reducer asserts
        self._steps.setup(trainer)
        # The ranks have met and the model is in sync: signals are the run's from here on
        if isinstance(self._launcher, JobSubprocessLauncher):
            self._launcher.startup_done()

    @override
    def configure_ddp(self) -> None:
        if self._comm_hook == "powersgd" and self._ddp_comm_state is None:
            self._ddp_comm_state = build_comm_hook(
                "powersgd", powersgd_rank=self._powersgd_rank, powersgd_start_iter=self._powersgd_start_iter
            )[0]
        super().configure_ddp()

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning's version registers only when the root device is CUDA
        assert isinstance(self.model, DistributedDataParallel)
        hook, wrapper = self._ddp_comm_hook, self._ddp_comm_wrapper
        if hook is not None:
            self.model.register_comm_hook(self._ddp_comm_state, hook if wrapper is None else wrapper(hook))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return dataloader
        if trainer.training:
            self._rows = None
            dataloader = train_loader(
                dataloader, trainer, self.global_rank, self.world_size, self._planned, self._uneven, self._resume
            )
        elif not trainer.predicting:
            dataloader = self._steps.evaluation_loader(dataloader, self.world_size, self.global_rank)
        if not trainer.training and isinstance(dataloader, DataLoader) and dataloader.generator is None:
            # Making an iterator draws the workers' base seed from the loader's generator, else
            # from the global stream: a resumed run, which makes its evaluation iterators at other
            # points (no sanity check, persistent workers), would shift the training stream.
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            dataloader.generator = torch.Generator().manual_seed(loader_seed(seed, trainer.global_rank, _EVAL_LOADER))
        if isinstance(dataloader, DataLoader) and dataloader.num_workers > 0:
            dataloader.worker_init_fn = WorkerInit(
                dataloader.worker_init_fn, trainer.global_rank, restates=_is_lightning_seeding
            )
            context = dataloader.multiprocessing_context
            start_method = context.get_start_method() if context is not None else multiprocessing.get_start_method()
            if start_method == "forkserver":
                start_forkserver()  # now, deaf to the job's stop signals, not at the first batch
        return dataloader

    # The per-step agreement (contracts.StepAgreement): the flags ride in the uneven shards' round

    def add_flag_source(self, source: Callable[[], int]) -> None:
        """Have ``source()`` (this rank's stop flag, a signal number or 0) agreed in each step's round."""
        if source not in self._flag_sources:
            self._flag_sources.append(source)

    def remove_flag_source(self, source: Callable[[], int]) -> None:
        if source in self._flag_sources:
            self._flag_sources.remove(source)

    def agreed_flag(self) -> int | None:
        """The largest flag any rank raised, agreed with the current batch's row counts (``None``:
        this run's training data makes no per-step round: uneven data is off or not needed)."""
        return self._uneven.agreed_flag

    def _raised_flag(self) -> int:
        return max((int(source()) for source in self._flag_sources), default=0)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume.checkpoint_loaded(checkpoint.get(CHECKPOINT_KEY))
        return checkpoint

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.lightning_module is not None:
            trainer, rank, world = self.lightning_module.trainer, self.global_rank, self.world_size
            rows = self._uneven.batch_rows(trainer, world) or self._planned.batch_rows(trainer, batch_idx, rank, world)
            if rows is not None:
                self._rows = rows

    @property
    def batch_rows(self) -> BatchRows | None:
        """Rows of the current micro-batch on a global plan or uneven shards (``None`` on neither); under
        manual optimization, weight a mean loss by ``loss_weight / accumulate_grad_batches``."""
        return self._rows

    def _mark(self, phase: str, waits: bool = False) -> None:
        if self._room is not None:
            trainer = self._trainer()
            self._room.mark(f"{phase} (global step {trainer.global_step if trainer is not None else 0})", waits)

    def _waiting(self, phase: str, call: Callable[[], Any]) -> Any:
        """``call()``, a collective every rank must enter, marked for the liveness room."""
        before = self._room.phase if self._room is not None else ""
        self._mark(phase, waits=True)
        result = call()
        if self._room is not None:
            self._room.mark(before)
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._mark("a validation step")
        step = functools.partial(super().validation_step, *args, **kwargs)
        return self._steps.evaluation_step(self._trainer(), "validation_step", args, step)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._mark("a test step")
        return self._steps.evaluation_step(
            self._trainer(), "test_step", args, functools.partial(super().test_step, *args, **kwargs)
        )

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._mark("a predict step")
        return super().predict_step(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._mark("a training step")
        context, step = (
            self.precision_plugin.train_step_context,
            functools.partial(super().training_step, *args, **kwargs),
        )
        return self._steps.training_step(self._trainer(), self._rows, self._planned.plan, context, step, args)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        parent = super().backward
        return self._waiting("a backward", lambda: self._steps.backward(  # DDP's all-reduce waits for every rank
            closure_loss, self.lightning_module, self._rows, self.precision_plugin,
            lambda loss: parent(loss, optimizer, *args, **kwargs),
        ))  # fmt: skip

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        if is_mean(reduce_op) and not tensor.is_floating_point():
            # Lightning's mean divides an integer tensor in place and truncates; epoch means divide
            # by the integer count of rows, so 127 rows on 2 ranks would count as 63 per rank
            tensor = tensor.double()
        # a tensor logged with sync_dist may sit where the backend cannot take it (a CPU metric on nccl):
        # it is reduced on the group's device and comes back where it was
        device, tensor = tensor.device, for_collective(tensor, group)
        parent = super().reduce
        steps = self._steps
        return self._waiting(
            "a reduce (sync_dist)", lambda: steps.reduce(tensor, group, reduce_op, lambda t, g, op: parent(t, g, op))
        ).to(device)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # every rank gets here in step (contracts.GathersPerRankState): no state_dict has to communicate
        self.gather_per_rank_state(checkpoint)
        if self.is_global_zero:  # the rank that writes it (DDPStrategy.save_checkpoint)
            self._add_records(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        self.last_checkpoint_path = str(filepath)

    def _add_records(self, checkpoint: dict[str, Any]) -> None:
        """What every checkpoint this strategy writes carries beside Lightning's: the fingerprint of
        its state, and the data layout a resume is checked against."""
        checkpoint[FINGERPRINT_KEY] = state_fingerprint(
            checkpoint.get("state_dict"), checkpoint.get("optimizer_states")
        )
        record = self._resume.checkpoint_record(self.lightning_module, self._planned)
        if record is not None:
            checkpoint[CHECKPOINT_KEY] = record

    def gather_per_rank_state(self, checkpoint: dict[str, Any]) -> None:
        """Replace every callback's per-rank part with all ranks' (contracts.GathersPerRankState)."""
        gather_per_rank(checkpoint)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._failed(exception)

    def _failed(self, error: BaseException) -> None:
        # a collective that failed is a RuntimeError on every backend (gloo's are plain ones); an agreed
        # stop (Preempted, a SystemExit) or a refusal (a ValueError) is every rank's own, and goes through
        if self._room is not None and self._room.marks and isinstance(error, RuntimeError):  # after start-up
            self._room.failed(error)  # another rank caused it: named in one line, and the job ends here

    @override
    def teardown(self) -> None:
        self._steps.teardown()
        if self._room is not None:
            self._room.stop()
            self._room = None
        super().teardown()
        if self._comm_hook == "powersgd":
            self._ddp_comm_state = None  # a fresh PowerSGD state for the next fit
        for key in self._env_set:  # what this strategy put into the environment does not outlive fit
            os.environ.pop(key, None)
        self._env_set = []
        os.environ.update(self._env_rewritten)  # and what it rewrote gets the user's value back
        self._env_rewritten = {}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method, what in (
            ("ddp_plugins", "popen", "child processes re-run the script"),
            ("ddp_plugins_spawn", "spawn", "spawned child processes"),
            ("ddp_plugins_notebook", "fork", "forked child processes, for notebooks"),
        ):
            strategy_registry.register(
                name, cls, description=f"ddp_plugins DDP strategy: {what}", start_method=start_method, override=True
            )


def _is_lightning_seeding(fn: Any) -> bool:
    """Lightning's worker seeding (``seed_everything(workers=True)``), which :class:`WorkerInit` restates."""
    return fn is pl_worker_init_function


_EVAL_LOADER = 2**31  # the epoch slot of evaluation loaders' generator seed (no training epoch reaches it)


DDPPluginsStrategy.register_strategies(StrategyRegistry)
