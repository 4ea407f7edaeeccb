"""The app's config: its schema, composing it as Hydra's command line does, and the ``auto`` choices."""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch
from hydra import compose, version
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from ddp_plugins import _compat
from ddp_plugins.core.preemption import stable_run_name

__all__ = [
    "CONFIG_MODULE",
    "CONFIG_NAME",
    "PRECISIONS",
    "SCHEMA_NAME",
    "CheckpointConfig",
    "ConfigError",
    "NameConfig",
    "NetworkConfig",
    "Precision",
    "TrainConfig",
    "compose_config",
    "config_error",
    "group_options",
    "resolve_devices",
    "resolve_precision",
    "trainer_args",
    "run_dir",
]

CONFIG_MODULE = "ddp_plugins.conf"
CONFIG_NAME = "train"
SCHEMA_NAME = "train_schema"
Precision = Literal["32-true", "64-true", "16-mixed", "bf16-mixed"]  # what resolve_precision returns
PRECISIONS = ("auto", *typing.get_args(Precision))


@dataclass
class NameConfig:
    """A group that picks one name (``backend``, ``precision``): its option sets ``name``."""

    name: str = MISSING


@dataclass
class NetworkConfig:
    """``network``: environment variables set before the process group starts."""

    env: dict[str, Any] = field(
        default_factory=dict, metadata={"allowed": "a mapping of environment variable names to values"}
    )


@dataclass
class CheckpointConfig:
    """``checkpoint``: step checkpoints (0: epoch ends and signals only) and how many are kept."""

    every_n_train_steps: int = 0
    keep: int = 2


@dataclass
class TrainConfig:
    """The types of the app's top-level keys (groups of class arguments stay untyped: their classes check them)."""

    backend: NameConfig = MISSING
    precision: NameConfig = MISSING
    strategy: Any = MISSING
    trainer: Any = MISSING
    data: Any = MISSING
    model: Any = MISSING
    callbacks: dict[str, Any] | None = None
    network: NetworkConfig = field(default_factory=NetworkConfig)
    logger: Any = MISSING
    seed: int = 42
    deterministic: bool = False
    global_batch_size: int | None = None
    reproducible: bool = False
    resume: str = field(default="auto", metadata={"allowed": "'auto', 'never' or the path of a checkpoint file"})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    weights_only: bool = True


ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)


def run_dir(default: str) -> str:
    """``hydra.run.dir``'s resolver: ``outputs/<stable_run_name()>`` when the job has one, else ``default``."""
    name = stable_run_name()
    return f"outputs/{name}" if name else default


if not OmegaConf.has_resolver("ddp_plugins_run_dir"):
    OmegaConf.register_new_resolver("ddp_plugins_run_dir", run_dir)


class ConfigError(ValueError):
    """A configuration value that cannot work; ``str()`` is one line: ``<key> <problem>, allowed: <what is>``."""

    def __init__(self, key: str, problem: str, allowed: str) -> None:
        self.key, self.problem, self.allowed = key, problem, allowed
        super().__init__(one_line(f"{key} {problem}, allowed: {allowed}"))


def one_line(text: object) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def quoted_choices(values: Any) -> str:
    return ", ".join(f"'{v}'" for v in values)


def to_plain_dict(node: Any, *, resolve: bool) -> dict[str, Any]:
    """A config mapping node as a plain dict (the app's config keys are strings)."""
    container = OmegaConf.to_container(node, resolve=resolve)
    if not isinstance(container, dict):
        raise TypeError(f"expected a mapping config node, got {type(container).__name__}")
    return cast("dict[str, Any]", container)


def _schema_allowed(full_key: str) -> str | None:
    """What :class:`TrainConfig` allows at ``full_key``, in words (``an integer``); None off the schema."""
    hint: Any = TrainConfig
    metadata: Mapping[str, Any] = {}
    for part in full_key.split("."):
        fields = {f.name: f for f in dataclasses.fields(hint)} if dataclasses.is_dataclass(hint) else {}
        if part not in fields:
            return None
        hint, metadata = typing.get_type_hints(hint)[part], fields[part].metadata
    return str(metadata.get("allowed", _describe(hint)))


def _describe(hint: Any) -> str:
    """``int | None`` -> ``an integer or null``: what a schema type allows, in words."""
    args = typing.get_args(hint)
    if type(None) in args:
        return " or ".join([*(_describe(a) for a in args if a is not type(None)), "null"])
    if typing.get_origin(hint) is dict:
        return "a mapping"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"a mapping of {', '.join(f.name for f in dataclasses.fields(hint))}"
    words = {int: "an integer", bool: "true or false", str: "a string", float: "a number"}
    return words.get(hint, str(hint).replace("typing.", ""))


def config_error(err: BaseException) -> ConfigError | None:
    """The one-line :class:`ConfigError` for a value OmegaConf refused against the schema (in ``err``'s causes).

    Example::

        >>> try:
        ...     OmegaConf.structured(TrainConfig).seed = "abc"
        ... except ValidationError as err:
        ...     print(config_error(err))
        seed got 'abc', allowed: an integer
    """
    seen: BaseException | None = err
    while seen is not None and not isinstance(seen, ValidationError):
        seen = seen.__cause__ or seen.__context__
    key = str(getattr(seen, "full_key", "") or "")
    if seen is None or not key:
        return None
    allowed = _schema_allowed(key) or f"what the schema allows ({one_line(seen.msg)})"
    return ConfigError(key, f"got {getattr(seen, 'value', None)!r}", allowed)


def _conf_dir() -> Path:
    """The config folder, the packaged ``ddp_plugins.conf`` (the checkout's conf/ when editable)."""
    return Path(str(importlib.resources.files(CONFIG_MODULE)))


def group_options(group: str) -> list[str]:
    """The option names of a config group, as Hydra sees them (``backend`` -> ``['auto', ...]``).

    Example::

        >>> group_options("backend")
        ['auto', 'gloo', 'mpi', 'nccl']
    """
    folder = _conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def config_groups() -> list[str]:
    return sorted(p.name for p in _conf_dir().iterdir() if p.is_dir() and not p.name.startswith("_"))


def compose_config(
    overrides: list[str] | None = None, config_flags: list[str] | None = None, *, hydra_node: bool = False
) -> DictConfig:
    """Compose the app's config with Hydra's compose API (for checks, notebooks and tests).

    Args:
        overrides: ``key=value`` overrides, as on the command line.
        config_flags: ``--config-name`` / ``--config-dir`` / ``--config-path`` and their values.
        hydra_node: keep Hydra's own ``hydra`` node (run folder, job name) in the result.

    Raises:
        ConfigError: a value of the wrong type for the schema, or an override Hydra cannot apply.

    Example::

        >>> cfg = compose_config(["backend=gloo", "trainer.max_epochs=1"])
        >>> cfg.backend.name, cfg.trainer.max_epochs
        ('gloo', 1)
        >>> compose_config(["deterministic=maybe"])
        Traceback (most recent call last):
        ...
        ddp_plugins.app.config.ConfigError: deterministic got 'maybe', allowed: true or false
    """
    flags = dict(zip((config_flags or [])[::2], (config_flags or [])[1::2], strict=False))
    name = flags.get("--config-name", flags.get("-cn", CONFIG_NAME))
    path = flags.get("--config-path", flags.get("-cp"))
    extra_dir = flags.get("--config-dir", flags.get("-cd"))
    # Hydra's command line's search path: a `hydra.searchpath` override would miss a primary config in --config-dir
    primary = f"file://{Path(path).resolve()}" if path else f"pkg://{CONFIG_MODULE}"
    search_path = _compat.hydra_config_search_path(primary)
    if extra_dir:
        extra = f"file://{Path(extra_dir).resolve()}"
        search_path.prepend(provider="command-line", path=extra, anchor=SearchPathQuery(provider="schema"))
    GlobalHydra.instance().clear()
    version.setbase("1.3")
    try:
        _compat.hydra_create_main("app", search_path)
        return compose(config_name=name, overrides=list(overrides or []), return_hydra_config=hydra_node)
    except (HydraException, OmegaConfBaseException) as err:
        raise config_error(err) or ConfigError(
            "override", f"was refused by Hydra: {one_line(err)}", "keys of the config (`--cfg job` lists them)"
        ) from None
    finally:
        GlobalHydra.instance().clear()


def cuda_in_use(accelerator: str) -> bool:
    return accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())


CPU_PROCESSES = 2  # what `trainer.devices: auto` starts on a machine without CUDA (over gloo)


def resolve_devices(devices: Any, accelerator: str = "auto") -> Any:
    """``auto`` -> the launcher's processes per node, else one rank per GPU, else :data:`CPU_PROCESSES`.

    Example::

        >>> resolve_devices("auto", "cpu"), resolve_devices(3, "cpu")
        (2, 3)
    """
    if devices != "auto":
        return devices
    for key, step in (("LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"), ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_ID")):
        if os.environ.get(key, "").isdigit() and step in os.environ:
            return int(os.environ[key])
    return torch.cuda.device_count() if cuda_in_use(accelerator) else CPU_PROCESSES


def trainer_args(trainer: Any) -> dict[str, Any]:
    """The ``trainer`` config node as ``lightning.pytorch.Trainer`` arguments (``devices`` resolved)."""
    args = dict(trainer) if isinstance(trainer, dict) else to_plain_dict(trainer, resolve=True)
    args["devices"] = resolve_devices(args.get("devices", "auto"), str(args.get("accelerator", "auto")))
    return args


def resolve_precision(precision: str, accelerator: str = "auto", reproducible: bool = False) -> Precision:
    """The app's one precision check: ``auto`` -> ``bf16-mixed`` on a bf16 GPU unless reproducible, else ``32-true``.

    Raises:
        ConfigError: an unknown precision, ``16-mixed`` on CPU, ``bf16-mixed`` on a GPU without it.

    Example::

        >>> resolve_precision("auto", "cpu")
        '32-true'
    """
    if precision not in PRECISIONS:
        raise ConfigError("precision", f"got {precision!r}", f"one of {quoted_choices(PRECISIONS)}")
    cuda = cuda_in_use(accelerator)
    if precision == "auto":
        return "bf16-mixed" if cuda and not reproducible and torch.cuda.is_bf16_supported() else "32-true"
    if precision == "16-mixed" and not cuda:
        raise ConfigError(
            "precision",
            "got '16-mixed', which needs CUDA (float16 autocast with a GradScaler) on a CPU run",
            "'32-true', 'bf16-mixed' or 'auto' on CPU",
        )
    if precision == "bf16-mixed" and cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision", "got 'bf16-mixed' on a GPU without bfloat16", "'16-mixed', '32-true' or 'auto'")
    return cast(Precision, precision)  # one of PRECISIONS, not "auto"
