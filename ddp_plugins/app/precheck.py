"""The app's up-front check of every job, before Hydra makes a folder or any process starts."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import zipfile
from collections.abc import Mapping
from typing import Any

import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig

from ddp_plugins import _compat
from ddp_plugins.app.checks import as_config_error, build_objects, check_trainer_args
from ddp_plugins.app.config import (
    CheckpointConfig,
    ConfigError,
    TrainConfig,
    compose_config,
    config_error,
    config_groups,
    cuda_in_use,
    group_options,
    one_line,
    quoted_choices,
    to_plain_dict,
    trainer_args,
)
from ddp_plugins.app.hydra_args import split_config_flags
from ddp_plugins.core.checkpoints import NO_DIGEST, verify_checkpoint
from ddp_plugins.core.checks import ArgumentError, ArgumentTypeError, ArgumentValueError, check_int
from ddp_plugins.core.seeding import check_seed
from ddp_plugins.lightning.safe_loading import UnsafeCheckpointError, safe_loading
from ddp_plugins.lightning.strategy import check_backend

__all__ = [
    "SUBMITIT_LAUNCHERS",
    "check_config",
    "check_resume",
    "checkpoint_position",
    "load_checkpoint_safely",
    "max_cpu_processes",
    "precheck",
    "single_run_config",
]

CPU_PROCESSES_PER_CORE = 2  # processes per core `trainer.devices` may ask for on a CPU: more only thrashes
_HYDRA_INFO_FLAGS = ("-h", "--help", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "--version")


def precheck(argv: list[str]) -> None:
    """Every check that can run before Hydra makes a folder or Lightning starts a process (each job of a sweep)."""
    config_flags, argv = split_config_flags(argv)
    if any(arg in _HYDRA_INFO_FLAGS or arg.startswith(("--cfg=", "--info=")) for arg in argv):
        return  # Hydra answers (help, printed config) and starts nothing
    multirun = any(arg in ("-m", "--multirun") for arg in argv)
    overrides = [arg for arg in argv if not arg.startswith("-")]
    _check_group_choices(overrides)
    tasks = _submitit_tasks(overrides)
    for job in _jobs(overrides, multirun):
        cfg = compose_config(job, config_flags)
        check_config(cfg)
        if tasks is not None:
            _check_slurm_tasks(cfg, *tasks)


def single_run_config(argv: list[str]) -> DictConfig | None:
    """A single run's config with Hydra's node and run folder resolved; None for sweeps and info flags."""
    config_flags, argv = split_config_flags(argv)
    if any(arg in (*_HYDRA_INFO_FLAGS, "-m", "--multirun") or arg.startswith(("--cfg=", "--info=")) for arg in argv):
        return None
    cfg = compose_config([arg for arg in argv if not arg.startswith("-")], config_flags, hydra_node=True)
    try:
        cfg.hydra.run.dir = str(cfg.hydra.run.dir)
    except Exception as err:  # noqa: BLE001 - an interpolation or resolver error, reported as one line
        raise ConfigError("hydra.run.dir", f"cannot be resolved: {one_line(err)}", "a folder path") from None
    return cfg


SUBMITIT_LAUNCHERS = ("submitit_slurm", "submitit_local")


def _submitit_tasks(overrides: list[str]) -> tuple[int, int] | None:
    """(tasks per node, nodes) of a ``hydra/launcher=submitit_*`` sweep; None for other launchers."""
    values = dict(arg.lstrip("+").partition("=")[::2] for arg in overrides if "=" in arg)
    launcher = values.get("hydra/launcher")
    if launcher not in SUBMITIT_LAUNCHERS:
        return None
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        raise ConfigError(
            "hydra/launcher",
            f"got '{launcher}', but hydra-submitit-launcher is not installed",
            "'basic' (the default), or submitit_slurm after `pip install 'ddp_plugins[slurm]'`",
        )
    counts = []
    for key in ("tasks_per_node", "nodes"):
        raw = values.get(f"hydra.launcher.{key}", "1")
        try:
            counts.append(check_int(key, int(raw), 1))
        except (ValueError, ArgumentError):
            raise ConfigError(f"hydra.launcher.{key}", f"got {raw!r}", "a positive integer") from None
    return counts[0], counts[1]


def _check_slurm_tasks(cfg: DictConfig, tasks_per_node: int, nodes: int) -> None:
    """Lightning runs one DDP process per Slurm task: the job's tasks must be the trainer's processes."""
    trainer = cfg.get("trainer") or {}
    for key, tasks, lightning in (("tasks_per_node", tasks_per_node, "devices"), ("nodes", nodes, "num_nodes")):
        wanted = trainer.get(lightning, 1)
        if isinstance(wanted, int) and wanted != tasks:
            raise ConfigError(
                f"hydra.launcher.{key}",
                f"got {tasks}, but trainer.{lightning} is {wanted}",
                f"hydra.launcher.{key}={wanted} (one Slurm task per DDP process)",
            )


def _check_group_choices(overrides: list[str]) -> None:
    """``group=choice`` (sweeps and lists value by value) against the group's options."""
    groups = set(config_groups())
    for arg in overrides:
        key, _, value = arg.lstrip("+~").partition("=")
        if key not in groups or not value:
            continue
        options = group_options(key)
        for choice in (v.strip() for v in value.strip("[]").split(",") if value.strip("[]")):
            if key == "callbacks" and choice in ("null", "none", ""):
                continue
            if choice not in options:
                raise ConfigError(key, f"got '{choice}'", f"one of {quoted_choices(options)}")


def _jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override list of every job: one without ``-m``, each sweep combination with it."""
    overrides = [o for o in overrides if not o.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))]
    if not multirun:
        return [overrides]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        batches = _compat.hydra_sweep_batches(parsed)
    except HydraException as err:
        raise ConfigError("override", f"cannot be parsed: {one_line(err)}", "key=value, key=a,b (a sweep)") from None
    return [job for batch in batches for job in batch]


def check_config(cfg: DictConfig) -> None:
    """Check a composed app config by building every object it describes (nothing is started)."""
    raw = to_plain_dict(cfg, resolve=False)
    try:
        resolved = to_plain_dict(cfg, resolve=True)
    except Exception as err:  # noqa: BLE001 - an interpolation or resolver error, reported as one line
        raise config_error(err) or ConfigError(  # config_error: an interpolated value of the wrong type
            "config", f"cannot be resolved: {one_line(err)}", "valid ${...} interpolations"
        ) from None
    _check_top_level(resolved, raw)
    build_objects(cfg)


def _check_top_level(resolved: dict[str, Any], raw: dict[str, Any]) -> None:
    """What the schema's types do not say: bounds, the resume checkpoint, keys added with ``+``."""
    with as_config_error("seed", raw):
        check_seed(resolved.get("seed"))
    with as_config_error("global_batch_size", raw):
        check_int("global_batch_size", resolved.get("global_batch_size"), 1, allow_none=True)
    with as_config_error("resume", raw):
        check_resume(resolved.get("resume", "auto"), weights_only=resolved.get("weights_only", True) is not False)
    checkpoint = resolved.get("checkpoint") or {}
    checkpoint_keys = [f.name for f in dataclasses.fields(CheckpointConfig)]
    for key in checkpoint:  # `+checkpoint.<key>=...` adds past the schema (Hydra opens the node)
        if key not in checkpoint_keys:
            raise ConfigError(f"checkpoint.{key}", "is not a key of the app's config", quoted_choices(checkpoint_keys))
    for key, minimum in (("every_n_train_steps", 0), ("keep", 1)):
        with as_config_error(f"checkpoint.{key}", raw):
            check_int(key, checkpoint.get(key, getattr(CheckpointConfig, key)), minimum)
    known = set(config_groups()) | {f.name for f in dataclasses.fields(TrainConfig)}
    for key in resolved:
        if key not in known and key != "hydra":
            raise ConfigError(key, "is not a key of the app's config", quoted_choices(sorted(known)))
    env = (resolved.get("network") or {}).get("env") or {}
    if not isinstance(env, Mapping) or any(isinstance(v, (Mapping, list)) for v in env.values()):
        raise ConfigError("network.env", f"got {env!r}", "a mapping of environment variable names to values")
    trainer = trainer_args(resolved.get("trainer") or {})
    accelerator = str(trainer.get("accelerator", "auto"))
    with as_config_error("backend", raw):  # with the trainer's accelerator, which the strategy's check lacks
        check_backend(resolved["backend"]["name"], accelerator)
    check_trainer_args(trainer)
    _check_devices(trainer.get("devices", "auto"), accelerator)
    _check_global_batch(resolved.get("strategy") or {}, trainer)


def check_resume(resume: Any, weights_only: bool = True) -> str:
    """``resume``: ``"auto"``, ``"never"`` or the path of a checkpoint that verifies and loads (with ``weights_only``).

    Example::

        >>> check_resume("auto")
        'auto'
        >>> check_resume("no/such.ckpt")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `resume` should be ... got 'no/such.ckpt' (no such file).
    """
    allowed = "'auto', 'never' or the path of a checkpoint file"
    if not isinstance(resume, str):
        raise ArgumentTypeError("resume", allowed, resume)
    if resume in ("auto", "never"):
        return resume
    reason = verify_checkpoint(resume)
    if reason is None or reason.startswith(NO_DIGEST):  # no digest to check: taken unverified
        try:
            checkpoint_position(resume, weights_only=weights_only)
            return resume
        except ValueError as err:
            reason = str(err)
    raise ArgumentValueError("resume", allowed, problem=f"got {resume!r} ({reason})")


def checkpoint_position(path: str | os.PathLike, weights_only: bool = True) -> tuple[int, int]:
    """(epoch, global step) of a Lightning checkpoint (``state_dict`` and ``loops``), else a ``ValueError``."""
    checkpoint = load_checkpoint_safely(path, weights_only=weights_only)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError("not a Lightning checkpoint (no state_dict)")
    if not isinstance(checkpoint.get("loops"), dict):
        raise ValueError("not a Lightning checkpoint (a state_dict without loops: weights alone, not Trainer.fit's)")
    return int(checkpoint.get("epoch", 0)), int(checkpoint.get("global_step", 0))


def load_checkpoint_safely(path: str | os.PathLike, weights_only: bool = True) -> Any:
    """``torch.load(path, weights_only=True)`` with :data:`~ddp_plugins.lightning.safe_loading.SAFE_GLOBALS`.

    Memory-mapped on the CPU; a refusal is a one-line ``ValueError``; ``weights_only=False`` loads anything."""
    # mmap needs torch.save's zip format: another file is read whole, so torch's message says why it fails
    what = "" if zipfile.is_zipfile(path) else "not a zip archive written by torch.save, "
    try:
        with safe_loading(path) if weights_only else contextlib.nullcontext():
            return torch.load(path, map_location="cpu", mmap=not what, weights_only=weights_only)
    except UnsafeCheckpointError as err:
        raise ValueError(
            f"does not load with weights_only=True: {what}{err.held}; weights_only=false loads it if you trust"
            " the file, or save plain types in the hyperparameters"
        ) from None
    except Exception as err:  # noqa: BLE001 - torch raises many kinds; the caller reports one line
        first = one_line(err).split(". ")[0][:200]
        loaded = "with weights_only=True" if weights_only else "(weights_only=false)"
        raise ValueError(f"does not load {loaded}: {what}{type(err).__name__}: {first}") from None


def _check_global_batch(strategy: Mapping[str, Any], trainer: Mapping[str, Any]) -> None:
    """A global batch with fewer rows than ranks x micro-batches would leave every step partly empty."""
    g, devices, nodes = strategy.get("global_batch_size"), trainer.get("devices"), trainer.get("num_nodes", 1)
    accumulate = trainer.get("accumulate_grad_batches", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (g, devices, nodes, accumulate)):
        return  # null, "auto", or a type the strategy's own check names
    if g < devices * nodes * accumulate:
        raise ConfigError(
            "global_batch_size",
            f"got {g}, fewer rows than ranks x micro-batches ({devices * nodes} x {accumulate})",
            f"at least {devices * nodes * accumulate}",
        )


def max_cpu_processes() -> int:
    """The most DDP processes `trainer.devices` may ask for on a CPU node."""
    return CPU_PROCESSES_PER_CORE * (os.cpu_count() or 1)


def _check_devices(devices: Any, accelerator: str) -> None:
    cuda = cuda_in_use(accelerator)
    available = torch.cuda.device_count() if cuda else 0
    if devices == "auto" or (cuda and devices == -1):  # on CUDA Lightning also takes -1 (every GPU)
        return
    if cuda and isinstance(devices, (list, tuple)):  # and a list of GPU indices
        if not devices or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < available for d in devices):
            raise ConfigError("trainer.devices", f"got {list(devices)!r}", f"GPU indices between 0 and {available - 1}")
        return
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError("trainer.devices", f"got {devices!r}", "a positive integer or 'auto'")
    if cuda and devices > available:
        raise ConfigError(
            "trainer.devices", f"got {devices}, more GPUs than this machine has ({available})", f"1 to {available}"
        )
    if not cuda and devices > max_cpu_processes():
        raise ConfigError(
            "trainer.devices",
            f"got {devices}, more CPU processes than this machine runs well ({os.cpu_count()} cores)",
            f"1 to {max_cpu_processes()} ({CPU_PROCESSES_PER_CORE} per CPU core)",
        )
