"""DDP strategy.

:class:`DDPPluginsStrategy` is Lightning's ``DDPStrategy`` with what the app and the plugins need on
top, registered in Lightning's ``StrategyRegistry`` as ``ddp_plugins`` (child processes started
with ``subprocess``), ``ddp_plugins_spawn`` and ``ddp_plugins_notebook`` (fork):

* ``backend``: ``auto`` (nccl on CUDA, gloo otherwise), ``gloo``, ``nccl`` or ``mpi``, checked
  when the strategy is built, before any process starts.
* ``timeout``: the collective timeout in seconds, a number from config.
* Child ranks of a Hydra job re-run *this job* only: Lightning's launcher re-runs the whole
  command line, so under ``--multirun`` every child rank re-ran the whole sweep into a second
  multirun folder. Children get the job's own overrides and its output folder instead.
* Every process ends through :func:`ddp_plugins.distributed.exit_process` (spawned children
  included), which avoids the gloo abort at interpreter exit described there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from ddp_plugins.config import check_backend
from ddp_plugins.distributed import exit_process

__all__ = ["DDPPluginsStrategy", "apply_network_env"]

_START_METHODS = ("popen", "spawn", "fork", "forkserver")


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
    # Only this job's overrides (no --multirun, no sweep), and this job's own output folder.
    command += list(hydra_cfg.overrides.task)
    command += [
        f'hydra.run.dir="{hydra_cfg.runtime.output_dir}"',
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
    ]
    return command, get_original_cwd()


class _JobSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, with child commands from :func:`_job_subprocess_cmd`.

    The body is Lightning's ``_call_children_scripts``; only the command differs, and Lightning
    builds it inline, so the method is restated here.
    """

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
    parent's ``atexit`` handlers), so they are left as they are.
    """

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        if self._start_method != "fork":
            exit_process(0)


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
    """Lightning's DDP strategy with a checked ``backend``, a timeout in seconds and clean exits.

    Args:
        backend: ``"auto"`` (nccl on CUDA, gloo otherwise), ``"gloo"``, ``"nccl"`` or ``"mpi"``.
        timeout: timeout of collectives and of the rendezvous, in seconds.
        start_method: ``"popen"`` (children re-run the script), ``"spawn"``, ``"fork"``
            (notebooks) or ``"forkserver"``.
        **kwargs: passed to Lightning's ``DDPStrategy`` and from there to
            ``DistributedDataParallel`` (``bucket_cap_mb``, ``find_unused_parameters``, ...).

    Raises:
        ValueError: an unknown backend or start method, a backend this machine cannot run, or a
            timeout that is not a positive number.

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
        **kwargs: Any,
    ) -> None:
        check_backend(backend, str(kwargs.get("accelerator") or "auto"))
        if start_method not in _START_METHODS:
            raise ValueError(
                f"`start_method` should be one of {', '.join(map(repr, _START_METHODS))}, got {start_method!r}."
            )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"`timeout` should be a positive number of seconds, got {timeout!r}.")
        super().__init__(
            process_group_backend=None if backend == "auto" else backend,
            timeout=timedelta(seconds=timeout),
            start_method=start_method,
            **kwargs,
        )
        self._backend = backend
        self._timeout_s = float(timeout)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _JobSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _CleanExitMultiprocessingLauncher(self, start_method=self._start_method)

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


DDPPluginsStrategy.register_strategies(StrategyRegistry)
