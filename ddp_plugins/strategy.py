"""DDP strategy
============

:class:`DDPPluginsStrategy` is Lightning's ``DDPStrategy`` with what multi-node users fight for,
registered in Lightning's ``StrategyRegistry`` as ``ddp_plugins`` (child processes re-run the
script), ``ddp_plugins_spawn`` and ``ddp_plugins_notebook`` (fork):

* ``backend``: ``auto`` (nccl on CUDA, gloo otherwise), ``gloo``, ``nccl`` or ``mpi``, checked
  when the strategy is built, before any process starts.
* ``comm_hook`` by name: ``none``, ``fp16``, ``bf16`` or ``powersgd`` (torch's own hooks from
  ``torch.distributed.algorithms.ddp_comm_hooks``), registered on *every* device. Lightning's
  ``DDPStrategy`` registers hooks only on CUDA and silently drops them on CPU, although fp16
  compression and PowerSGD work on gloo; ``bf16`` needs NCCL 2.10+ and is refused elsewhere with
  a one-line error before any process starts. On gloo, PowerSGD waits for each bucket's reduction
  (``_powersgd_hook``): otherwise its follow-up all-reduces race with other collectives and gloo
  aborts on a collective mismatch.
* ``timeout``: the collective timeout in seconds, a number from config.
* ``bucket_cap_mb``, ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``:
  passed through to ``DistributedDataParallel``.
* ``Trainer(sync_batchnorm=True)`` installs :class:`ddp_plugins.SyncBatchNormPlugin` (any device)
  instead of torch's CUDA-only ``SyncBatchNorm``; this is why the module imports
  :mod:`ddp_plugins.sync_batchnorm`.
* No hangs when a rank fails. Child ranks are watched every second: when one exits non-zero or is
  killed by a signal, the launcher says which rank, how, and stops every rank (Lightning's own
  watcher logs at INFO, which is usually hidden, and checks every 5 s). When rank 0 itself raises,
  its child ranks are stopped instead of being left blocked in a collective. A rank whose
  collective fails because a peer stopped gets that said in its error message.
* Child ranks of a Hydra job re-run *this job* only: Lightning's launcher re-runs the whole
  command line, so under ``--multirun`` every child rank re-ran the whole sweep into a second
  multirun folder. Children get the job's own overrides and its output folder instead.
* Every process ends through :func:`ddp_plugins.distributed.exit_process` (spawned children
  included), which avoids the gloo abort at interpreter exit described there.

Which interfaces listen (single node)
-------------------------------------
Two kinds of sockets exist. The rendezvous store (``torch.distributed.TCPStore``, started by rank
0 on ``MASTER_PORT``) listens on *every* interface (``[::]``, IPv4 and IPv6) whatever
``MASTER_ADDR`` says: torch offers no way to bind it to one address, so on a shared machine keep
``MASTER_PORT`` firewalled or use a trusted network. The gloo data connections between ranks bind
to one interface: when ``MASTER_ADDR`` is a loopback address (Lightning's default ``127.0.0.1`` on
one node) and the user did not choose one, this strategy sets ``GLOO_SOCKET_IFNAME`` to the
loopback interface, so gradients never leave the machine's loopback.

Example::

    >>> strategy = DDPPluginsStrategy(backend="gloo", comm_hook="fp16", timeout=120, bucket_cap_mb=50)
    >>> strategy.comm_hook, strategy.process_group_backend, strategy._ddp_kwargs["bucket_cap_mb"]
    ('fp16', 'gloo', 50)
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ddp_plugins.config import check_backend, check_comm_hook, split_config_flags
from ddp_plugins.distributed import exit_process, get_rank, get_world_size
from ddp_plugins.sync_batchnorm import SyncBatchNormPlugin

__all__ = ["DDPPluginsStrategy", "apply_network_env", "build_comm_hook"]

log = logging.getLogger(__name__)

_START_METHODS = ("popen", "spawn", "fork", "forkserver")
# Seconds a child rank gets to exit on its own once rank 0 failed, before it is killed.
_CHILD_GRACE_S = 2.0
# Messages of a collective that failed because a peer is gone (gloo, NCCL, the TCP store).
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out",
    "timed out",
    "Socket Timeout",
    "NCCL communicator was aborted",
    "failed to recv",
    "failed to send",
)


def build_comm_hook(
    name: str,
    process_group: Any = None,
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 1000,
) -> tuple[Any, Callable[..., Any] | None]:
    """The ``(state, hook)`` pair for a communication hook name, for ``DistributedDataParallel``.

    Usable without Lightning: ``ddp_model.register_comm_hook(*build_comm_hook("fp16"))``. The
    hooks are torch's own (``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook`` with a
    fresh ``PowerSGDState``: build one pair per DDP model, PowerSGD keeps per-model state).

    Args:
        name: ``"none"`` (DDP's default all-reduce; returns ``(None, None)``), ``"fp16"``,
            ``"bf16"`` or ``"powersgd"``.
        process_group: the group to reduce over; ``None`` is the default group.
        powersgd_rank: PowerSGD's ``matrix_approximation_rank`` (>= 1).
        powersgd_start_iter: PowerSGD's ``start_powerSGD_iter``: plain all-reduce before it
            (>= 2, PowerSGD's error feedback needs two warm-up iterations).

    Raises:
        ValueError: an unknown name or a PowerSGD argument out of range.

    Example::

        >>> state, hook = build_comm_hook("powersgd", powersgd_rank=2, powersgd_start_iter=10)
        >>> hook.__name__, state.matrix_approximation_rank, state.start_powerSGD_iter
        ('_powersgd_hook', 2, 10)
    """
    check_comm_hook(name)
    _check_int("powersgd_rank", powersgd_rank, 1)
    _check_int("powersgd_start_iter", powersgd_start_iter, 2)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "none":
        return None, None
    if name == "fp16":
        return process_group, default_hooks.fp16_compress_hook
    if name == "bf16":
        return process_group, default_hooks.bf16_compress_hook
    state = powerSGD_hook.PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=powersgd_rank,
        start_powerSGD_iter=powersgd_start_iter,
    )
    return state, _powersgd_hook


def _powersgd_hook(state, bucket):  # type: ignore[no-untyped-def]
    """torch's ``powerSGD_hook``; on backends other than NCCL it returns once the bucket is reduced.

    PowerSGD issues its second and third all-reduce from a future callback. On NCCL these are
    ordered on the stream; on gloo the callbacks run on gloo's own threads whenever the previous
    collective completes, so they can interleave differently on each rank with the next bucket's
    all-reduce or with any other collective of the backward pass (SyncBatchNorm's), and gloo then
    aborts on a collective mismatch. Waiting here keeps every rank's collectives in one order, at the
    price of not overlapping this bucket's reduction with the rest of the backward pass. No type
    annotations: DDP compares them with the real classes.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    future = powerSGD_hook(state, bucket)
    if dist.get_backend(state.process_group) != "nccl":
        future.wait()
    return future


def apply_network_env(env: Mapping[str, Any] | None) -> dict[str, str]:
    """Set a network preset's variables in ``os.environ`` before the process group starts.

    A variable the user already set keeps the user's value. Child ranks inherit the result.

    Returns:
        The effective value of every variable the preset names.

    Example::

        >>> os.environ["EXAMPLE_TIMEOUT"] = "5"
        >>> apply_network_env({"EXAMPLE_TIMEOUT": 22, "EXAMPLE_RETRY": 7})
        {'EXAMPLE_TIMEOUT': '5', 'EXAMPLE_RETRY': '7'}
    """
    effective = {}
    for key, value in (env or {}).items():
        os.environ.setdefault(str(key), str(value))
        effective[str(key)] = os.environ[str(key)]
    return effective


class DDPPluginsStrategy(DDPStrategy):
    """Lightning's DDP strategy with hooks by name on every backend, timeouts in seconds, no hangs.

    Args:
        backend: ``"auto"`` (nccl on CUDA, gloo otherwise), ``"gloo"``, ``"nccl"`` or ``"mpi"``.
        timeout: timeout of collectives and of the rendezvous, in seconds.
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
        **kwargs: passed to Lightning's ``DDPStrategy`` and from there to
            ``DistributedDataParallel``.

    Raises:
        ValueError: an unknown backend, start method or hook, a backend this machine cannot run,
            ``bf16`` on a backend without it, or a number out of range.

    Example::

        >>> DDPPluginsStrategy(backend="gloo", timeout=60).process_group_backend
        'gloo'
    """

    strategy_name = "ddp_plugins"

    def __init__(
        self,
        backend: str = "auto",
        timeout: float = 1800.0,
        start_method: str = "popen",
        comm_hook: str = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 1000,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        **kwargs: Any,
    ) -> None:
        check_backend(backend, str(kwargs.get("accelerator") or "auto"))
        if start_method not in _START_METHODS:
            raise ValueError(
                f"`start_method` should be one of {', '.join(map(repr, _START_METHODS))}, got {start_method!r}."
            )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"`timeout` should be a positive number of seconds, got {timeout!r}.")
        check_comm_hook(comm_hook, backend if backend in ("gloo", "mpi") else None)
        _check_int("powersgd_rank", powersgd_rank, 1)
        _check_int("powersgd_start_iter", powersgd_start_iter, 2)
        if bucket_cap_mb is not None and (
            isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0
        ):
            raise ValueError(f"`bucket_cap_mb` should be a positive number of MiB or None, got {bucket_cap_mb!r}.")
        for flag, value in (
            ("find_unused_parameters", find_unused_parameters),
            ("static_graph", static_graph),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"`{flag}` should be True or False, got {value!r}.")
        if comm_hook != "none" and kwargs.get("ddp_comm_hook") is not None:
            raise ValueError(
                f"`comm_hook={comm_hook!r}` and `ddp_comm_hook={kwargs['ddp_comm_hook']!r}` both set the hook."
                " Give one: a name in `comm_hook`, or a callable in `ddp_comm_hook` with comm_hook='none'."
            )
        ddp_kwargs = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
        }
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(
            process_group_backend=None if backend == "auto" else backend,
            timeout=timedelta(seconds=timeout),
            start_method=start_method,
            **ddp_kwargs,
            **kwargs,
        )
        self._backend = backend
        self._timeout_s = float(timeout)
        self._comm_hook = comm_hook
        self._powersgd_rank = powersgd_rank
        self._powersgd_start_iter = powersgd_start_iter
        if comm_hook != "none":
            # set now so that callbacks (AllReduceCounter) can wrap it in `setup`; the state is
            # built per fit in `configure_ddp`
            self._ddp_comm_hook = build_comm_hook(comm_hook)[1]

    @property
    def comm_hook(self) -> str:
        """The communication hook's name (``"none"`` when a callable was given or none at all)."""
        return self._comm_hook

    @property
    def _layer_sync(self) -> LayerSync | None:
        return self.__layer_sync

    @_layer_sync.setter
    def _layer_sync(self, plugin: LayerSync | None) -> None:
        # `Trainer(sync_batchnorm=True)` hands every strategy torch's CUDA-only SyncBatchNorm plugin
        # (through the accelerator connector); this strategy takes the device-agnostic one instead
        self.__layer_sync = SyncBatchNormPlugin() if isinstance(plugin, TorchSyncBatchNorm) else plugin

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Lightning calls this once accelerator and devices are known, before any process starts
        if self.accelerator is not None and self.parallel_devices:
            check_comm_hook(self._comm_hook, self._get_process_group_backend())
        if self._start_method == "popen":
            self._launcher = _JobSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _CleanExitMultiprocessingLauncher(self, start_method=self._start_method)

    @override
    def setup_distributed(self) -> None:
        backend = self._get_process_group_backend()
        check_comm_hook(self._comm_hook, backend)
        if backend == "gloo" and os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
            # torch 2.13: DistributedDataParallel(...) segfaults in its construction logging when the
            # debug level is DETAIL on gloo (even a bare nn.Linear); INFO keeps the other debug checks
            rank_zero_warn(
                "TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DistributedDataParallel on gloo with this torch"
                f" ({torch.__version__}, a segfault while DDP is built); using INFO instead."
            )
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
            dist.set_debug_level(dist.DebugLevel.INFO)
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
            assert self.cluster_environment is not None
            loopback = _loopback_interface()
            if loopback is not None and _is_loopback(self.cluster_environment.main_address):
                os.environ["GLOO_SOCKET_IFNAME"] = loopback
        super().setup_distributed()

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
        _register_ddp_comm_hook(
            model=self.model,
            ddp_comm_state=self._ddp_comm_state,
            ddp_comm_hook=self._ddp_comm_hook,
            ddp_comm_wrapper=self._ddp_comm_wrapper,
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if get_world_size() == 1:
            return
        note = (
            f"\n[ddp_plugins] rank {get_rank()}: a collective failed because another rank stopped (it raised,"
            " was killed, or waits elsewhere). That rank's own error, printed by it, is the cause."
        )
        exception.args = tuple(
            arg + note if isinstance(arg, str) and any(text in arg for text in _PEER_GONE) else arg
            for arg in exception.args
        )

    @override
    def teardown(self) -> None:
        super().teardown()
        if self._comm_hook == "powersgd":
            self._ddp_comm_state = None  # a fresh PowerSGD state for the next fit

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method, what in (
            ("ddp_plugins", "popen", "child processes re-run the script"),
            ("ddp_plugins_spawn", "spawn", "spawned child processes"),
            ("ddp_plugins_notebook", "fork", "forked child processes, for notebooks"),
        ):
            strategy_registry.register(
                name,
                cls,
                description=f"ddp_plugins DDP strategy: {what}",
                start_method=start_method,
                override=True,
            )


def _job_subprocess_cmd(local_rank: int) -> tuple[list[str], str | None]:
    """The command that starts child rank ``local_rank`` of the current (Hydra) job."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return list(_basic_subprocess_cmd()), None

    import __main__
    from hydra.utils import get_original_cwd, to_absolute_path

    hydra_cfg = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    # The config the user chose, only this job's overrides (no --multirun, no sweep), and this
    # job's own output folder.
    command += split_config_flags(sys.argv[1:])[0]
    command += list(hydra_cfg.overrides.task)
    command += [
        f'hydra.run.dir="{hydra_cfg.runtime.output_dir}"',
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
    ]
    return command, get_original_cwd()


class _RankWatcher(threading.Thread):
    """Watches the child ranks; when one fails, says which and how, and stops every rank.

    Lightning's ``_ChildProcessObserver`` does the same every 5 s but reports at INFO level,
    which is usually hidden; this one prints to stderr, names the signal, and can be stopped
    (when rank 0 itself failed and stops its children).
    """

    def __init__(self, procs: list[Any], period: float = 1.0) -> None:
        super().__init__(daemon=True, name="ddp-plugins-rank-watcher")
        self.procs = procs
        self.period = period
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    @override
    def run(self) -> None:
        while not self._halt.wait(self.period):
            codes = [proc.poll() for proc in self.procs]
            if all(code == 0 for code in codes):
                return
            failed = [(rank, proc, code) for rank, (proc, code) in enumerate(zip(self.procs, codes), 1) if code]
            if failed and not self._halt.is_set():
                rank, proc, code = failed[0]
                print(
                    f"[ddp_plugins] rank {rank} (PID {proc.pid}) {_describe_exit(code)}; stopping every rank.",
                    file=sys.stderr,
                    flush=True,
                )
                for other in self.procs:
                    if other.poll() is None:
                        other.send_signal(signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)


class _JobSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher: job-scoped child commands, a rank watcher, no orphans.

    ``_call_children_scripts`` is Lightning's body with the command from
    :func:`_job_subprocess_cmd` (Lightning builds it inline, so the method is restated);
    ``launch`` is Lightning's with :class:`_RankWatcher` instead of its observer, and stops the
    child ranks when rank 0 raises (Lightning only does so for ``KeyboardInterrupt``, leaving
    them blocked in a collective until the timeout).
    """

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        watcher = None
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            watcher = _RankWatcher(self.procs)
            watcher.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException:
            if watcher is not None:
                watcher.stop()
                self._stop_children()
            raise

    def _stop_children(self) -> None:
        deadline = time.monotonic() + _CHILD_GRACE_S
        while time.monotonic() < deadline and any(proc.poll() is None for proc in self.procs):
            time.sleep(0.1)
        running = [proc for proc in self.procs if proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGKILL)
        failed_first = [
            f"rank {rank} (PID {proc.pid}) {_describe_exit(proc.returncode)}"
            for rank, proc in enumerate(self.procs, 1)
            if proc not in running and proc.returncode
        ]
        cause = f"{'; '.join(failed_first)} first, then rank 0 failed" if failed_first else "rank 0 failed"
        print(
            f"[ddp_plugins] {cause}; stopped child ranks {[proc.pid for proc in running]}.",
            file=sys.stderr,
            flush=True,
        )

    @override
    def _call_children_scripts(self) -> None:
        import subprocess

        self._check_can_spawn_children()
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            env_copy = os.environ.copy()
            env_copy["LOCAL_RANK"] = f"{local_rank}"
            if os.environ.get("PL_GLOBAL_SEED") is None and "PL_GLOBAL_SEED" in env_copy:
                del env_copy["PL_GLOBAL_SEED"]
            command, cwd = _job_subprocess_cmd(local_rank)
            self.procs.append(subprocess.Popen(command, env=env_copy, cwd=cwd))


class _CleanExitMultiprocessingLauncher(_MultiProcessingLauncher):
    """Spawned children leave through :func:`exit_process` once their results are queued.

    A ``spawn``/``forkserver`` child is a fresh interpreter that would otherwise finalize and risk
    the gloo abort; ``fork`` children already leave with ``os._exit`` (and must not run the
    parent's ``atexit`` handlers), so they are left as they are. A failing child is handled by
    torch's ``ProcessContext.join``: it stops the others and raises with the child's traceback.
    """

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        if self._start_method != "fork":
            exit_process(0)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` should be an integer >= {minimum}, got {value!r}.")


def _is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP or a host name) is a loopback address of this machine."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def _loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), if there is one."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


DDPPluginsStrategy.register_strategies(StrategyRegistry)
