"""DDPPluginsStrategy (``ddp_plugins``, ``_spawn``, ``_notebook``); see docs/design.md, "When a rank fails or stops"."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import DoublePrecision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from ddp_plugins import _compat
from ddp_plugins.core.checkpoints import gather_per_rank
from ddp_plugins.core.checks import ArgumentValueError, check_bool, check_choice, check_int, check_number
from ddp_plugins.core.comm_hooks import build_comm_hook, check_comm_hook
from ddp_plugins.core.liveness import Liveness, Record, Verdict, rendezvous_error
from ddp_plugins.core.preemption import restart_scoped_store
from ddp_plugins.core.process import start_forkserver
from ddp_plugins.core.ranks import for_collective
from ddp_plugins.core.samplers import loader_seed
from ddp_plugins.core.workers import WorkerInit
from ddp_plugins.lightning import comm_hook_chain, data_plan, resume, steps, traps
from ddp_plugins.lightning.checkpoint_io import AtomicCheckpointIO
from ddp_plugins.lightning.launchers import CleanExitMultiprocessingLauncher, JobSubprocessLauncher, leave_ended_job
from ddp_plugins.lightning.layer_sync import SyncBatchNormPlugin
from ddp_plugins.lightning.network import is_loopback, pin_gloo_to_loopback
from ddp_plugins.lightning.reproducible import FINGERPRINT_KEY, ReproducibleSteps, state_fingerprint

__all__ = ["BACKENDS", "DDPPluginsStrategy", "check_backend"]

BACKENDS = ("auto", "gloo", "nccl", "mpi")
_START_METHODS = ("popen", "spawn", "fork", "forkserver")


def check_backend(backend: Any, accelerator: str = "auto") -> None:
    """Check that ``backend`` names a process-group backend this machine can run (``ArgumentValueError`` if not).

    Example::

        >>> check_backend("foo")
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `backend` should be one of 'auto', 'gloo', 'nccl', 'mpi', got 'foo'.
    """
    check_choice("backend", backend, BACKENDS)
    problem, hint, cuda = None, "", torch.cuda.is_available()
    if backend == "nccl" and (not cuda or accelerator == "cpu"):
        problem = f"got 'nccl' without CUDA GPUs (cuda available: {cuda}, accelerator: {accelerator!r})"
    elif backend == "nccl" and not dist.is_nccl_available():
        problem = "got 'nccl' with a torch built without NCCL"
    elif backend == "mpi" and not dist.is_mpi_available():
        problem = f"got 'mpi' with a torch built without MPI ({torch.__version__}; dist.is_mpi_available() is False)"
        hint = "Use backend=gloo, or build torch from source against your MPI."
    if problem is not None:
        allowed = "'auto' or 'gloo' (or a backend this machine can run)"
        raise ArgumentValueError("backend", allowed, problem=problem, hint=hint)


def _seconds(name: str, value: Any, allow_none: bool = False) -> Any:
    """``value`` in seconds (a ``timedelta``, Lightning's type, converted), checked positive."""
    value = value.total_seconds() if isinstance(value, timedelta) else value
    what = "seconds (or a datetime.timedelta)"
    check_number(name, value, 0, exclusive_minimum=True, allow_none=allow_none, what=what)
    return value


class DDPPluginsStrategy(DDPStrategy):
    """Lightning's DDP strategy with hooks by name on every backend, timeouts in seconds, no hangs.

    Args:
        backend: ``"auto"`` (nccl on CUDA, else gloo), ``"gloo"``, ``"nccl"``, ``"mpi"`` (or ``process_group_backend``).
        timeout: timeout of collectives (and of the rendezvous by default), in seconds or a ``timedelta``.
        rendezvous_timeout: how long the ranks wait for each other at start-up (``None``: ``timeout``).
        start_method: ``"popen"`` (children re-run the script), ``"spawn"``, ``"fork"`` (notebooks) or ``"forkserver"``.
        comm_hook: ``"none"`` (with a ``ddp_comm_hook=callable`` too), ``"fp16"``, ``"bf16"`` (nccl) or ``"powersgd"``.
        powersgd_rank: PowerSGD's matrix approximation rank.
        powersgd_start_iter: the iteration from which PowerSGD compresses (plain all-reduce before).
        bucket_cap_mb: DDP's gradient bucket size in MiB (``None``: torch's default, 25).
        find_unused_parameters: let DDP find parameters that got no gradient.
        static_graph: tell DDP the graph is the same every iteration.
        gradient_as_bucket_view: gradients are views into DDP's buckets (saves a copy).
        global_batch_size: rows per optimizer step of one global plan per epoch (``None``: ``DistributedSampler``).
        drop_last: with ``global_batch_size``, leave out each epoch's short last step.
        uneven_data: ranks whose loaders yield different numbers of batches step together, rows weighted.
        stall_name_after: seconds without progress after which a stalled rank is named in one line (``None``: off).
        stall_end_after: seconds until a stall of ranks stopped or gone ends the job, rescue first (``None``: never).
        stall_end_running: end at ``stall_end_after`` also a stall of ranks whose processes run (default: named).
        child_command: ``local_rank -> (command, working folder)`` of each child rank under ``start_method="popen"``.
        reproducible: with ``global_batch_size``, the same bits on 1 to ``virtual_shards`` ranks.
        virtual_shards: the reproducible mode's shards per step (the same for runs to compare).
        **kwargs: passed to Lightning's ``DDPStrategy`` and from there to ``DistributedDataParallel``.

    Example::

        >>> DDPPluginsStrategy(backend="gloo", timeout=60).process_group_backend
        'gloo'
    """

    strategy_name = "ddp_plugins"

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
        stall_end_running: bool = False,
        child_command: Callable[[int], tuple[list[str], str | None]] | None = None,
        reproducible: bool = False,
        virtual_shards: int = 8,
        **kwargs: Any,
    ) -> None:
        process_group_backend = kwargs.pop("process_group_backend", None)  # Lightning's name for `backend`
        if process_group_backend is not None and backend not in ("auto", process_group_backend):
            allowed = f"the same as `backend` ({backend!r}) or left out"
            raise ArgumentValueError("process_group_backend", allowed, process_group_backend)
        backend = backend if process_group_backend is None else process_group_backend
        known = dist.Backend.backend_list  # torch's others too (ucc, a plugin's), as DDPStrategy takes them
        if process_group_backend is None or backend in BACKENDS or str(backend).lower() not in known:
            check_backend(backend, str(kwargs.get("accelerator") or "auto"))
        check_choice("start_method", start_method, _START_METHODS)
        timeout_s, rendezvous_s = _seconds("timeout", timeout), _seconds("rendezvous_timeout", rendezvous_timeout, True)
        if rendezvous_s not in (None, timeout_s) and backend not in ("auto", "gloo", "nccl"):
            raise ArgumentValueError(
                "rendezvous_timeout", "None or `timeout` on this backend", rendezvous_s,
                hint=f"torch changes a {backend!r} group's timeout only when it is made; gloo and nccl take both.",
            )  # fmt: skip
        check_comm_hook(comm_hook, backend if backend in ("gloo", "mpi") else None)
        check_int("powersgd_rank", powersgd_rank, 1)
        check_int("powersgd_start_iter", powersgd_start_iter, 2)
        check_number("bucket_cap_mb", bucket_cap_mb, 0, exclusive_minimum=True, what="MiB", allow_none=True)
        ddp_kwargs: dict[str, Any] = {"find_unused_parameters": find_unused_parameters, "static_graph": static_graph}
        ddp_kwargs["gradient_as_bucket_view"] = gradient_as_bucket_view
        flags = {"drop_last": drop_last, "uneven_data": uneven_data, "reproducible": reproducible}
        for name, value in {**ddp_kwargs, **flags, "stall_end_running": stall_end_running}.items():
            check_bool(name, value)
        check_int("global_batch_size", global_batch_size, 1, allow_none=True)
        check_number("stall_name_after", stall_name_after, 0, exclusive_minimum=True, what="seconds", allow_none=True)
        check_number("stall_end_after", stall_end_after, stall_name_after or 0, what="seconds", allow_none=True)
        check_int("virtual_shards", virtual_shards, 1)
        bypassed = {"comm_hook": comm_hook, "ddp_comm_hook": kwargs.get("ddp_comm_hook"), **ddp_kwargs}
        self._steps = (
            ReproducibleSteps(virtual_shards, global_batch_size, **bypassed) if reproducible else steps.PlannedSteps()
        )
        if comm_hook != "none" and kwargs.get("ddp_comm_hook") is not None:
            raise ArgumentValueError(
                "comm_hook", "'none' when `ddp_comm_hook` is given", comm_hook,
                hint="Give one: a name in `comm_hook`, or a callable in `ddp_comm_hook`.",
            )  # fmt: skip
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        leave_ended_job()  # an earlier Hydra job's group and variables (a sweep in the user's own app)
        super().__init__(
            process_group_backend=None if backend == "auto" else backend, timeout=timedelta(seconds=timeout_s),
            start_method=start_method, **ddp_kwargs, **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip
        self._backend, self._child_command = backend, child_command
        self._stall = (stall_name_after, stall_end_after)
        self._stall_end_running = stall_end_running
        self._room: Liveness | None = None
        self._step_buffers: dict[str, torch.Tensor] | None = None  # as the step under way began, for the rescue
        self._held_buffers: list[str] | None = None
        self._timeout_s, self._rendezvous_s = float(timeout_s), float(rendezvous_s or timeout_s)
        self._env_before: dict[str, str | None] = {}  # the user's values of what setup_distributed may set
        self.checkpoint_paths: list[str] = []  # contracts.SavesCheckpoints
        self.comm_hook = comm_hook  # the hook's name ("none" when a callable was given or none at all)
        self._powersgd = {"powersgd_rank": powersgd_rank, "powersgd_start_iter": powersgd_start_iter}
        self.global_batch_size = global_batch_size
        self.virtual_shards = self._steps.virtual_shards  # contracts.ShardsEachStep
        self._planned = data_plan.PlannedLoader(global_batch_size, drop_last, self._steps.virtual_shards)
        self._uneven = data_plan.UnevenShards(uneven_data)  # shards in step; the stop flags ride in their round
        self._resume = resume.ResumeRecord()  # the data layout checkpoints keep, and where a resume starts
        # rows of the micro-batch (None: no plan nor uneven shards); manual optimization: loss * loss_weight / K
        self.batch_rows: data_plan.BatchRows | None = None
        if comm_hook != "none":  # now, for callbacks to wrap in `setup`; the state is built per fit in configure_ddp
            self._ddp_comm_hook = build_comm_hook(comm_hook)[1]

    @override
    def _configure_launcher(self) -> None:
        self._settle()
        check, env = self._check_before_launch, self.cluster_environment
        if self._start_method != "popen":
            self._launcher = CleanExitMultiprocessingLauncher(self, self._start_method, before_launch=check)
            return
        self._launcher = JobSubprocessLauncher(
            env, self.num_processes, self.num_nodes, before_launch=check, child_command=self._child_command,
            watch_after_startup=self._stall[0] is None,  # else the liveness room names a failed rank
            on_failure=self._failed,
        )  # fmt: skip

    def _settle(self) -> None:
        """Check what needs the built Trainer and put the pack's plugins in place, before any process starts."""
        env, expected = self.cluster_environment, self.num_processes * self.num_nodes
        assert env is not None  # Lightning's message, before a bare IndexError, when torchrun started more ranks
        if env.creates_processes_externally and (world_size := env.world_size()) != expected:
            raise ArgumentValueError(
                "devices", f"devices x num_nodes = the world size the launcher started ({world_size})",
                problem=f"got devices={self.num_processes} x num_nodes={self.num_nodes} = {expected}",
                hint="Match `Trainer(devices=..., num_nodes=...)` to torchrun's --nproc-per-node/--nnodes or Slurm.",
            )  # fmt: skip
        # torch's TorchSyncBatchNorm runs on accelerators only: ours replaces it (a subclass of it is kept)
        sync = SyncBatchNormPlugin() if type(self._layer_sync) is TorchSyncBatchNorm else self._layer_sync
        self._layer_sync = self._steps.layer_sync(sync)
        if self._backend == "nccl" and (per_gpu := self._ranks_per_gpu()) > 1:  # NCCL's "invalid usage"
            raise ArgumentValueError(
                "backend", "'gloo' or 'auto' when ranks share a GPU",
                problem=f"got 'nccl' with {per_gpu} ranks on each of this machine's {torch.cuda.device_count()}"
                " GPU(s); nccl needs a GPU per rank",
                hint="Use backend=auto (gloo with CUDA tensors here), or as many ranks per machine as GPUs.",
            )  # fmt: skip
        if self.accelerator is not None and self.parallel_devices:
            check_comm_hook(self.comm_hook, self._get_process_group_backend())
        if self._checkpoint_io is None:  # else one given in `Trainer(plugins=...)`
            self._checkpoint_io = AtomicCheckpointIO()  # a checkpoint file is whole or absent

    def _ranks_per_gpu(self) -> int:
        """This host's ranks per GPU (0 off CUDA); every rank is this host's on a loopback main address."""
        if self.root_device.type != "cuda":
            return 0
        if (gpus := torch.cuda.device_count()) == 0:  # CUDA not visible to this process: nothing to tell
            return 1
        env = self.cluster_environment
        return math.ceil(self.num_processes * (self.num_nodes if env and is_loopback(env.main_address) else 1) / gpus)

    @override
    def _get_process_group_backend(self) -> str:
        backend = super()._get_process_group_backend()
        if self._backend == "auto" and backend == "nccl" and self._ranks_per_gpu() > 1:
            return "gloo"  # auto: nccl only when every rank has a GPU of its own; gloo takes CUDA tensors
        return backend

    def _check_before_launch(self, trainer: Any, arguments: dict[str, Any] | None = None) -> None:
        """Check what needs the Trainer's callbacks before any rank starts (``arguments``: the launched function's)."""
        if self.global_batch_size is not None:
            world_size = self.num_processes * self.num_nodes
            data_plan.check_global_batch(self.global_batch_size, world_size, data_plan.run_accumulation(trainer))
            loader = (arguments or {}).get("train_dataloaders")
            self._steps.before_launch(trainer, world_size, loader, self._planned.drop_last)

    @override
    def setup_distributed(self) -> None:
        assert self.cluster_environment is not None
        env = self.cluster_environment
        if self._get_process_group_backend() == "gloo":  # teardown gives back the user's values
            self._env_before = {key: os.environ.get(key) for key in ("TORCH_DISTRIBUTED_DEBUG", "GLOO_SOCKET_IFNAME")}
            if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":  # torch 2.13: DDP segfaults on gloo
                rank_zero_warn(
                    "TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DistributedDataParallel on gloo with this torch"
                    f" ({torch.__version__}, a segfault while DDP is built); using INFO instead."
                )
                os.environ["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
                dist.set_debug_level(dist.DebugLevel.INFO)
            pin_gloo_to_loopback(env.main_address)
        try:
            self._make_process_group()
        except (dist.DistStoreError, dist.DistNetworkError) as err:
            raise rendezvous_error(err, env.main_address, env.main_port, self.world_size, self._rendezvous_s) from None
        if self._rendezvous_s != self._timeout_s:  # the ranks have met: collectives get their own timeout
            _compat.set_group_timeout(self._timeout_s)
        name_after, end_after = self._stall
        if name_after is not None and self.world_size > 1:
            self._room = Liveness(
                _compat.default_store(), self.global_rank, self.world_size, name_after, end_after,
                rescue=self._save_last_completed_step, end_running=self._stall_end_running,
                collective_timeout_s=self._timeout_s, defers=self._launcher_ends,
                folder=lambda: getattr(self._trainer(), "default_root_dir", None),  # the run's folder
            ).start()  # fmt: skip

    def _launcher_ends(self, verdict: Verdict, records: Sequence[Record]) -> bool:
        """Whether the launcher's watcher ends the job for this verdict (a child rank gone during start-up)."""
        if verdict.how != "gone" or not isinstance(self._launcher, JobSubprocessLauncher):
            return False
        pids = [record.pid for record in records if record.rank in verdict.ranks]
        return len(pids) == len(verdict.ranks) and self._launcher.speaks_for(pids)

    def _save_last_completed_step(self) -> str | None:
        """The liveness room's rescue: the last completed step's state in ``step-<N>-stalled.ckpt``.

        The stalled ranks' random states cannot be gathered (:class:`RankAwareSeed` says so)."""
        trainer = self._trainer()
        if trainer is None or not trainer.training:
            return None
        dirpath = next((c.dirpath for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)), None)
        folder = Path(dirpath or Path(trainer.default_root_dir) / "checkpoints")
        checkpoint = _compat.dump_checkpoint(trainer)
        state = checkpoint.get("state_dict", {})  # the step under way's forward may have moved the buffers
        state.update((name, value) for name, value in (self._step_buffers or {}).items() if name in state)
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
        """Make the process group with the rendezvous timeout, under torchrun on this restart round's keys.

        Lightning's ``_init_dist_connection`` then finds it made."""
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
            device = self.root_device if self.root_device.type != "cpu" else None
            dist.init_process_group(
                self._get_process_group_backend(), store=store, rank=rank, world_size=size,
                timeout=timedelta(seconds=self._rendezvous_s), device_id=device,
            )  # fmt: skip
        super().setup_distributed()

    @override
    def setup(self, trainer: Any) -> None:
        traps.warn_compiled_module(self.lightning_module)  # before dynamo fails in `self.log`
        super().setup(trainer)
        traps.check_static_graph(trainer)  # DDP wrapped the model; before torch's reducer asserts
        self._steps.setup(trainer)
        if isinstance(self._launcher, JobSubprocessLauncher):  # the ranks met: signals are the run's from here on
            self._launcher.startup_done()

    @override
    def configure_ddp(self) -> None:
        if self.comm_hook == "powersgd" and self._ddp_comm_state is None:
            self._ddp_comm_state = build_comm_hook("powersgd", **self._powersgd)[0]
        super().configure_ddp()

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning's registers on CUDA only; the callbacks' layers (comm_hook_chain) wrap the hook here
        assert isinstance(self.model, DistributedDataParallel)
        hook, wrapper = comm_hook_chain.layered(self, self._ddp_comm_hook), self._ddp_comm_wrapper
        if hook is not None:
            self.model.register_comm_hook(self._ddp_comm_state, hook if wrapper is None else wrapper(hook))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if (trainer := self._trainer()) is None:
            return dataloader
        if trainer.training:
            self.batch_rows = None
            dataloader = data_plan.train_loader(
                dataloader, trainer, self.global_rank, self.world_size, self._planned, self._uneven, self._resume
            )
        elif not trainer.predicting:
            dataloader = self._steps.evaluation_loader(dataloader, self.world_size, self.global_rank)
        if not trainer.training and isinstance(dataloader, DataLoader) and dataloader.generator is None:
            # else its iterators draw the workers' seed from the global stream, shifting a resumed run's
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            dataloader.generator = torch.Generator().manual_seed(loader_seed(seed, trainer.global_rank, _EVAL_LOADER))
        if isinstance(dataloader, DataLoader) and dataloader.num_workers > 0:
            init = WorkerInit(dataloader.worker_init_fn, trainer.global_rank, restates=_is_lightning_seeding)
            dataloader.worker_init_fn = init
            context = dataloader.multiprocessing_context or multiprocessing.get_context()
            if context.get_start_method() == "forkserver":
                start_forkserver()  # now, deaf to the job's stop signals, not at the first batch
        return dataloader

    def add_flag_source(self, source: Callable[[], int]) -> None:
        self._uneven.sources[source] = None

    def remove_flag_source(self, source: Callable[[], int]) -> None:
        self._uneven.sources.pop(source, None)

    def agreed_flag(self) -> int | None:
        return self._uneven.agreed_flag

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume.checkpoint_loaded(checkpoint.get(resume.CHECKPOINT_KEY))
        return checkpoint

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if (trainer := self._trainer()) is not None:
            rank, world = self.global_rank, self.world_size
            rows = self._uneven.batch_rows(trainer, world) or self._planned.batch_rows(trainer, batch_idx, rank, world)
            self.batch_rows = rows or self.batch_rows

    def _mark(self, phase: str, waits: bool = False) -> None:
        if self._room is not None:
            trainer = self._trainer()
            self._room.mark(f"{phase} (global step {trainer.global_step if trainer is not None else 0})", waits)

    @contextlib.contextmanager
    def _waiting(self, phase: str, then: str | None = None) -> Iterator[None]:
        """Mark the body, a collective every rank enters, for the liveness room as ``phase``.

        With ``then`` (the backward): ``phase``, then ``then``, not a wait (its collective shows in the stack)."""
        if then is None:
            with self._room.waiting(phase) if self._room is not None else contextlib.nullcontext():
                yield
        else:
            self._mark(phase, waits=True)  # no room: no marks
            yield
            self._mark(then)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", super().test_step, args, kwargs)

    def _evaluation_step(self, hook: str, step: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        self._mark(f"a {hook.replace('_', ' ')}")
        return self._steps.evaluation_step(self._trainer(), hook, args, functools.partial(step, *args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._mark("a predict step")
        return super().predict_step(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._mark("a training step")
        if self._room is not None:
            self._keep_step_buffers(args)
        step, rows = functools.partial(super().training_step, *args, **kwargs), self.batch_rows
        context = self.precision_plugin.train_step_context
        return self._steps.training_step(self._trainer(), rows, self._planned.plan, context, step, args)

    def _keep_step_buffers(self, args: tuple) -> None:
        """At an optimizer step's first micro-batch, keep the module's buffers for the rescue (a forward moves them)."""
        trainer, module = self._trainer(), self.lightning_module
        index = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
        if trainer is None or module is None or index % max(1, trainer.accumulate_grad_batches):
            return
        buffers = dict(module.named_buffers())
        if self._held_buffers is None:  # the persistent ones: the others are in no checkpoint
            self._held_buffers = [name for name in module.state_dict(keep_vars=True) if name in buffers]
        self._step_buffers = {name: buffers[name].detach().clone() for name in self._held_buffers if name in buffers}

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        result = super().optimizer_step(*args, **kwargs)
        self._step_buffers = None  # the step completed: the module's own buffers are the step's
        return result

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        parent = super().backward
        with self._waiting("a backward", then="after a backward"):  # DDP's all-reduce waits for every rank
            return self._steps.backward(
                closure_loss, self.lightning_module, self.batch_rows, self.precision_plugin,
                lambda loss: parent(loss, optimizer, *args, **kwargs),
            )  # fmt: skip

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        if steps.is_mean(reduce_op) and not tensor.is_floating_point():
            tensor = tensor.double()  # Lightning's mean divides an integer tensor in place, truncating
        device, tensor = tensor.device, for_collective(tensor, group)  # on the group's device (a CPU metric on nccl)
        with self._waiting("a reduce (sync_dist)"):
            return self._steps.reduce(tensor, group, reduce_op, super().reduce).to(device)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        # see docs/design.md, "Checkpoints and resume" (every bit of a float64 checkpoint)
        if isinstance(self.precision_plugin, DoublePrecision) and self.lightning_module is not None:
            self.precision_plugin.convert_module(self.lightning_module)
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self.gather_per_rank_state(checkpoint)  # every rank gets here in step: no state_dict communicates
        if self.is_global_zero:  # the rank that writes it (DDPStrategy.save_checkpoint)
            self._add_records(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        self.checkpoint_paths.append(str(filepath))

    def _add_records(self, checkpoint: dict[str, Any]) -> None:
        """Add the state's fingerprint and the data layout a resume is checked against."""
        state, optimizers = checkpoint.get("state_dict"), checkpoint.get("optimizer_states")
        checkpoint[FINGERPRINT_KEY] = state_fingerprint(state, optimizers)
        if (record := self._resume.checkpoint_record(self.lightning_module, self._planned)) is not None:
            checkpoint[resume.CHECKPOINT_KEY] = record

    def gather_per_rank_state(self, checkpoint: dict[str, Any]) -> None:
        """Replace every callback's per-rank part with all ranks' (``contracts.GathersPerRankState``)."""
        gather_per_rank(checkpoint)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._failed(exception)

    def _failed(self, error: BaseException) -> None:
        # a failed collective is a RuntimeError on every backend; an agreed stop or a refusal goes through
        room = self._room
        if room is not None:
            if room.marks and isinstance(error, RuntimeError):  # after start-up
                room.failed(error)  # ends the job here when another rank caused it
            room.stop(None if isinstance(error, (SystemExit, KeyboardInterrupt, resume.ResumeMismatch)) else error)

    @override
    def teardown(self) -> None:
        self._steps.teardown()
        self._resume.teardown()
        self._step_buffers = self._held_buffers = None
        if self._room is not None:
            self._room.stop()
            self._room = None
        super().teardown()
        if self.comm_hook == "powersgd":
            self._ddp_comm_state = None  # a fresh PowerSGD state for the next fit
        for key, value in self._env_before.items():  # the environment gets the user's values back
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
        self._env_before = {}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method, what in (
            ("ddp_plugins", "popen", "child processes re-run the script"),
            ("ddp_plugins_spawn", "spawn", "spawned child processes"),
            ("ddp_plugins_notebook", "fork", "forked child processes, for notebooks"),
        ):
            description = f"ddp_plugins DDP strategy: {what}"
            strategy_registry.register(name, cls, description=description, start_method=start_method, override=True)


def _is_lightning_seeding(fn: Any) -> bool:
    """Whether ``fn`` is Lightning's worker seeding, which :class:`WorkerInit` restates."""
    return fn is pl_worker_init_function


_EVAL_LOADER = 2**31  # the epoch slot of evaluation loaders' generator seed (no training epoch reaches it)


DDPPluginsStrategy.register_strategies(StrategyRegistry)
