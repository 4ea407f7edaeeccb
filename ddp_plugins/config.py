"""Configuration checks.

One place for every check of the app's configuration, run before any worker process starts, so
bad input ends with one clear line instead of a traceback from a child rank or a hang.

Hydra rejects an unknown group option itself, but with a multi-line report; :func:`check_overrides`
reads the command line first and names the valid choices on one line. :func:`validate` checks
the composed config: types and ranges of the numbers, and what the machine can do (CUDA for
nccl and float16, MPI in the torch build, how many processes the accelerator allows).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BACKENDS",
    "COMM_HOOKS",
    "ConfigError",
    "PRECISIONS",
    "check_backend",
    "check_comm_hook",
    "check_overrides",
    "split_config_flags",
    "group_options",
    "max_cpu_processes",
    "resolve_backend",
    "resolve_precision",
    "validate",
]

BACKENDS = ("auto", "gloo", "nccl", "mpi")
PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed")
# DDP communication hooks by name (ddp_plugins.strategy builds them).
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
# Processes per CPU core that `trainer.devices` may ask for on a CPU: more only thrashes.
CPU_PROCESSES_PER_CORE = 2


class ConfigError(ValueError):
    """A configuration value that cannot work; the message is one line, ready for the user."""


def _conf_dir() -> Path:
    """The config folder, the packaged ``ddp_plugins.conf`` (the checkout's conf/ when editable)."""
    import importlib.resources

    return Path(str(importlib.resources.files("ddp_plugins.conf")))


def group_options(group: str) -> list[str]:
    """The option names of a config group, as Hydra sees them (``backend`` -> ``['auto', ...]``)."""
    folder = _conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _groups() -> list[str]:
    return sorted(p.name for p in _conf_dir().iterdir() if p.is_dir() and not p.name.startswith("_"))


def _choices(values: Iterable[str]) -> str:
    return ", ".join(f"'{v}'" for v in values)


_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def split_config_flags(argv: Iterable[str]) -> tuple[list[str], list[str]]:
    """Split Hydra's config-selection flags (``--config-name x``, ``-cd=x``, ...) from the rest.

    Returns:
        The flags, each as ``[flag, value]`` pairs flattened, and every other argument.

    Example::

        >>> split_config_flags(["--config-name", "mine", "backend=gloo", "-cd=/etc/conf"])
        (['--config-name', 'mine', '-cd', '/etc/conf'], ['backend=gloo'])
    """
    flags: list[str] = []
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        name, has_value, value = arg.partition("=")
        if name in _CONFIG_FLAGS:
            flags += [name, value if has_value else next(args, "")]
        else:
            rest.append(arg)
    return flags, rest


def check_overrides(argv: Iterable[str]) -> None:
    """Check ``group=choice`` overrides on the command line before Hydra composes anything.

    Sweeps (``precision=32-true,bf16-mixed``) are checked value by value; list syntax for the
    ``callbacks`` group (``callbacks=[a,b]``) likewise.

    Raises:
        ConfigError: naming the group, the valid choices and what was received.
    """
    groups = set(_groups())
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in groups or not value:
            continue
        options = group_options(key)
        values = value.strip("[]").split(",") if value.strip("[]") else []
        for choice in (v.strip() for v in values):
            if choice in ("null", "none", "") and key == "callbacks":
                continue
            if choice not in options:
                raise ConfigError(
                    f"`{key}` should be one of {_choices(options)}, got '{choice}'. "
                    f"Pick one of them on the command line, e.g. {key}={options[0]}."
                )


def check_backend(backend: str, accelerator: str = "auto") -> None:
    """Check that ``backend`` exists and works on this machine.

    Raises:
        ConfigError: an unknown name, ``nccl`` without CUDA, ``mpi`` without an MPI-enabled torch.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"`backend` should be one of {_choices(BACKENDS)}, got {backend!r}.")
    if backend == "nccl":
        if not torch.cuda.is_available() or accelerator == "cpu":
            raise ConfigError(
                "`backend=nccl` needs CUDA GPUs, but this run has none "
                f"(torch.cuda.is_available()={torch.cuda.is_available()}, accelerator={accelerator!r}). "
                "Use backend=gloo or backend=auto."
            )
        if not dist.is_nccl_available():
            raise ConfigError("`backend=nccl`: this torch build has no NCCL. Use backend=gloo or backend=auto.")
    if backend == "mpi" and not dist.is_mpi_available():
        raise ConfigError(
            f"`backend=mpi` needs a torch built with MPI; this torch ({torch.__version__}) has none "
            "(torch.distributed.is_mpi_available() is False). Use backend=gloo or backend=auto, "
            "or build torch from source against your MPI."
        )


def check_comm_hook(comm_hook: Any, backend: str | None = None) -> None:
    """Check a DDP communication hook name, and that ``backend`` (when known) can run it.

    Raises:
        ConfigError: an unknown name, or ``bf16`` without NCCL 2.10+ (torch registers it on nccl only).
    """
    if comm_hook not in COMM_HOOKS:
        raise ConfigError(f"`comm_hook` should be one of {_choices(COMM_HOOKS)}, got {comm_hook!r}.")
    if comm_hook != "bf16" or backend is None:
        return
    nccl = torch.cuda.nccl.version() if backend == "nccl" and torch.cuda.is_available() else None
    if nccl is None or tuple(nccl)[:2] < (2, 10):
        found = f"NCCL {'.'.join(map(str, nccl))}" if nccl else f"the {backend} backend"
        raise ConfigError(
            f"`comm_hook='bf16'` needs the nccl backend with NCCL 2.10 or newer (torch registers it nowhere else),"
            f" got {found}. Use comm_hook='fp16' (any backend) or 'powersgd'."
        )


def _cuda_in_use(accelerator: str) -> bool:
    return accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())


def resolve_backend(backend: str, accelerator: str = "auto") -> str:
    """``auto`` -> ``nccl`` on CUDA, ``gloo`` otherwise; other names are checked and returned."""
    check_backend(backend, accelerator)
    if backend == "auto":
        return "nccl" if _cuda_in_use(accelerator) and dist.is_nccl_available() else "gloo"
    return backend


def resolve_precision(precision: str, accelerator: str = "auto") -> str:
    """``auto`` -> ``bf16-mixed`` on CUDA (when supported), ``32-true`` otherwise.

    Raises:
        ConfigError: an unknown precision, ``16-mixed`` on CPU, ``bf16-mixed`` on a GPU without it.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"`precision` should be one of {_choices(PRECISIONS)}, got {precision!r}.")
    cuda = _cuda_in_use(accelerator)
    if precision == "auto":
        return "bf16-mixed" if cuda and torch.cuda.is_bf16_supported() else "32-true"
    if precision == "16-mixed" and not cuda:
        raise ConfigError(
            "`precision=16-mixed` needs CUDA (float16 autocast with a GradScaler); this run is on CPU. "
            "Use precision=bf16-mixed or precision=32-true."
        )
    if precision == "bf16-mixed" and cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError("`precision=bf16-mixed`: this GPU has no bfloat16 support. Use precision=16-mixed.")
    return precision


def max_cpu_processes() -> int:
    """The most DDP processes `trainer.devices` may ask for on a CPU node."""
    return CPU_PROCESSES_PER_CORE * (os.cpu_count() or 1)


def _check_devices(devices: Any, accelerator: str) -> None:
    if devices == "auto":
        return
    if _cuda_in_use(accelerator):
        available = torch.cuda.device_count()
        # Lightning also takes -1 (every GPU) and a list of GPU indices on CUDA.
        if isinstance(devices, (list, tuple)):
            if not devices or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < available for d in devices):
                raise ConfigError(
                    f"`trainer.devices` should list GPU indices between 0 and {available - 1}, got {list(devices)!r}."
                )
            return
        if devices == -1:
            return
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"`trainer.devices` should be a positive integer or 'auto', got {devices!r}.")
    if _cuda_in_use(accelerator):
        if devices > available:
            raise ConfigError(
                f"`trainer.devices={devices}` asks for more GPUs than this machine has ({available}). "
                f"Use trainer.devices={available} or fewer."
            )
    elif devices > max_cpu_processes():
        raise ConfigError(
            f"`trainer.devices={devices}` asks for more CPU processes than allowed here: at most "
            f"{max_cpu_processes()} ({CPU_PROCESSES_PER_CORE} per CPU core, {os.cpu_count()} cores). "
            f"Use trainer.devices={max_cpu_processes()} or fewer."
        )


# key -> (kind, minimum); kind "int" or "number"; a missing key is not checked.
_NUMBERS: dict[str, tuple[str, float]] = {
    "trainer.max_epochs": ("int", -1),
    "trainer.min_epochs": ("int", 0),
    "trainer.max_steps": ("int", -1),
    "trainer.num_nodes": ("int", 1),
    "trainer.log_every_n_steps": ("int", 1),
    "trainer.check_val_every_n_epoch": ("int", 1),
    "trainer.accumulate_grad_batches": ("int", 1),
    "trainer.limit_train_batches": ("number", 0),
    "trainer.limit_val_batches": ("number", 0),
    "trainer.gradient_clip_val": ("number", 0),
    "data.batch_size": ("int", 1),
    "data.num_workers": ("int", 0),
    "data.num_samples": ("int", 1),
    "model.lr": ("number", 0),
    "strategy.timeout": ("number", 1),
    "strategy.bucket_cap_mb": ("number", 0),
    "strategy.powersgd_rank": ("int", 1),
    "strategy.powersgd_start_iter": ("int", 2),
    "seed": ("int", 0),
}


def _get(cfg: Mapping[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def _check_numbers(cfg: Mapping[str, Any]) -> None:
    for key, (kind, minimum) in _NUMBERS.items():
        value = _get(cfg, key)
        if value is _MISSING or value is None:
            continue
        ok_type = int if kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_type):
            what = "an integer" if kind == "int" else "a number"
            raise ConfigError(f"`{key}` should be {what} >= {minimum:g}, got {value!r}.")
        if value < minimum:
            raise ConfigError(f"`{key}` should be >= {minimum:g}, got {value!r}.")
    seed = _get(cfg, "seed")
    if isinstance(seed, int) and seed > 2**32 - 1:
        raise ConfigError(f"`seed` should be between 0 and {2**32 - 1}, got {seed}.")


def validate(cfg: Mapping[str, Any]) -> None:
    """Check a composed app config (a plain dict or a resolved ``DictConfig``).

    Raises:
        ConfigError: the first problem found, as one line.
    """
    _check_numbers(cfg)
    accelerator = str(_get(cfg, "trainer.accelerator") or "auto")
    backend = _get(cfg, "backend.name")
    if backend is not _MISSING:
        check_backend(str(backend), accelerator)
    precision = _get(cfg, "precision.name")
    if precision is not _MISSING:
        resolve_precision(str(precision), accelerator)
    devices = _get(cfg, "trainer.devices")
    if devices is not _MISSING:
        _check_devices(devices, accelerator)
    comm_hook = _get(cfg, "strategy.comm_hook")
    if comm_hook is not _MISSING:
        resolved = resolve_backend(str(backend), accelerator) if backend is not _MISSING else None
        check_comm_hook(comm_hook, resolved)
