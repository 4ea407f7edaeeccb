"""The app's up-front check
========================

Composes the config of every job and builds every configured object before Hydra makes a folder
or any process starts, so bad input ends with one line ``error: <key> ..., allowed: ...`` and exit
code 2.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.resources
import inspect
import logging
import os
import types
import typing
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, cast

import torch
from omegaconf import DictConfig, OmegaConf

from ddp_plugins import _compat
from ddp_plugins.core.checks import ArgumentError, ArgumentTypeError, ArgumentValueError, check_bool, check_int
from ddp_plugins.core.preemption import stable_run_name
from ddp_plugins.core.seeding import check_seed
from ddp_plugins.lightning.launchers import split_config_flags
from ddp_plugins.lightning.network import restore_env
from ddp_plugins.lightning.strategy import check_backend

__all__ = [
    "CONFIG_MODULE",
    "CONFIG_NAME",
    "PRECISIONS",
    "ConfigError",
    "Precision",
    "build_objects",
    "check_config",
    "check_resume",
    "checkpoint_position",
    "compose_config",
    "group_options",
    "load_checkpoint_safely",
    "max_cpu_processes",
    "precheck",
    "resolve_backend",
    "resolve_precision",
    "run_dir",
    "single_run_config",
]

CONFIG_MODULE = "ddp_plugins.conf"


def run_dir(default: str) -> str:
    """The run folder: ``outputs/slurm-<job>`` / ``outputs/torchrun-<run id>`` when the job has a
    stable id (so a requeued or restarted job finds its checkpoints), else ``default``.

    Registered as the ``ddp_plugins_run_dir`` resolver of ``hydra.run.dir`` in ``conf/train.yaml``.
    """
    name = stable_run_name()
    return f"outputs/{name}" if name else default


if not OmegaConf.has_resolver("ddp_plugins_run_dir"):
    OmegaConf.register_new_resolver("ddp_plugins_run_dir", run_dir)
CONFIG_NAME = "train"
PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed")
# What `resolve_precision` hands to `lightning.pytorch.Trainer(precision=...)`.
Precision = Literal["32-true", "16-mixed", "bf16-mixed"]
# Processes per CPU core that `trainer.devices` may ask for on a CPU: more only thrashes.
CPU_PROCESSES_PER_CORE = 2
# Trainer arguments the app sets from its own groups; `trainer.<these>` would clash.
_APP_TRAINER_ARGS = ("strategy", "precision", "callbacks", "logger", "default_root_dir", "plugins")
_HYDRA_INFO_FLAGS = ("-h", "--help", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "--version")


class ConfigError(ValueError):
    """A configuration value that cannot work; ``str()`` is one line: ``<key> <problem>, allowed: <what is>``."""

    def __init__(self, key: str, problem: str, allowed: str) -> None:
        self.key, self.problem, self.allowed = key, problem, allowed
        super().__init__(_one_line(f"{key} {problem}, allowed: {allowed}"))


def _one_line(text: object) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _to_dict(node: Any, *, resolve: bool) -> dict[str, Any]:
    """A config mapping node as a plain dict (the app's config keys are strings)."""
    container = OmegaConf.to_container(node, resolve=resolve)
    if not isinstance(container, dict):
        raise TypeError(f"expected a mapping config node, got {type(container).__name__}")
    return cast("dict[str, Any]", container)


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


def _groups() -> list[str]:
    return sorted(p.name for p in _conf_dir().iterdir() if p.is_dir() and not p.name.startswith("_"))


def _choices(values: Any) -> str:
    return ", ".join(f"'{v}'" for v in values)


# --------------------------------------------------------------------------- the command line


def precheck(argv: list[str]) -> None:
    """Every check that can run before Hydra makes a folder or Lightning starts a process.

    Under ``-m`` / ``--multirun`` each job of the sweep is composed and checked.

    Raises:
        ConfigError: the first problem found, as one line.
    """
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
    """The composed config of a single (not ``--multirun``) run, with Hydra's node (its run folder
    resolved as Hydra will resolve it); None for sweeps and for Hydra's info flags, which start no run.

    The app locks the run folder before Hydra writes ``.hydra/`` there, and hands Hydra the resolved
    path so that both agree (``${now:...}`` is resolved once).

    Raises:
        ConfigError: the run folder cannot be resolved, as one line.
    """
    config_flags, argv = split_config_flags(argv)
    if any(arg in _HYDRA_INFO_FLAGS or arg.startswith(("--cfg=", "--info=")) for arg in argv):
        return None
    if any(arg in ("-m", "--multirun") for arg in argv):
        return None
    cfg = compose_config([arg for arg in argv if not arg.startswith("-")], config_flags, hydra_node=True)
    try:
        cfg.hydra.run.dir = str(cfg.hydra.run.dir)
    except Exception as err:  # noqa: BLE001 - an interpolation or resolver error, reported as one line
        raise ConfigError("hydra.run.dir", f"cannot be resolved: {_one_line(err)}", "a folder path") from None
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
    groups = set(_groups())
    for arg in overrides:
        key, has_value, value = arg.partition("=")
        key = key.lstrip("+~")
        if not has_value or key not in groups or not value:
            continue
        options = group_options(key)
        for choice in (v.strip() for v in value.strip("[]").split(",") if value.strip("[]")):
            if key == "callbacks" and choice in ("null", "none", ""):
                continue
            if choice not in options:
                raise ConfigError(key, f"got '{choice}'", f"one of {_choices(options)}")


def _jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override list of every job: one without ``-m``, each sweep combination with it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    overrides = [o for o in overrides if not o.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))]
    if not multirun:
        return [overrides]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        batches = _compat.hydra_sweep_batches(parsed)
    except HydraException as err:
        raise ConfigError("override", f"cannot be parsed: {_one_line(err)}", "key=value, key=a,b (a sweep)") from None
    return [job for batch in batches for job in batch]


def compose_config(
    overrides: list[str] | None = None, config_flags: list[str] | None = None, *, hydra_node: bool = False
) -> DictConfig:
    """Compose the app's config with Hydra's compose API (for checks, notebooks and tests).

    Args:
        overrides: ``key=value`` overrides, as on the command line.
        config_flags: ``--config-name`` / ``--config-dir`` / ``--config-path`` and their values.
        hydra_node: keep Hydra's own ``hydra`` node (run folder, job name) in the result.

    Raises:
        ConfigError: an override Hydra cannot apply (unknown key, bad syntax), as one line.

    Example::

        >>> cfg = compose_config(["backend=gloo", "trainer.max_epochs=1"])
        >>> cfg.backend.name, cfg.trainer.max_epochs
        ('gloo', 1)
    """
    from hydra import compose, version
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    flags = dict(zip((config_flags or [])[::2], (config_flags or [])[1::2], strict=False))
    name = flags.get("--config-name", flags.get("-cn", CONFIG_NAME))
    path = flags.get("--config-path", flags.get("-cp"))
    extra_dir = flags.get("--config-dir", flags.get("-cd"))
    # The search path Hydra's own command line builds: a `hydra.searchpath` override instead
    # would not find a primary config that only --config-dir has.
    search_path = _compat.hydra_config_search_path(
        f"file://{Path(path).resolve()}" if path else f"pkg://{CONFIG_MODULE}"
    )
    if extra_dir:
        search_path.prepend(
            provider="command-line",
            path=f"file://{Path(extra_dir).resolve()}",
            anchor=SearchPathQuery(provider="schema"),
        )
    GlobalHydra.instance().clear()
    version.setbase("1.3")
    try:
        _compat.hydra_create_main("app", search_path)
        return compose(config_name=name, overrides=list(overrides or []), return_hydra_config=hydra_node)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(
            "override", f"was refused by Hydra: {_one_line(err)}", "keys of the config (`--cfg job` lists them)"
        ) from None
    finally:
        GlobalHydra.instance().clear()


# --------------------------------------------------------------------------- the composed config


def check_config(cfg: DictConfig) -> None:
    """Check a composed app config by building every object it describes (nothing is started).

    Raises:
        ConfigError: the first problem found, as one line naming the config key.
    """
    raw = _to_dict(cfg, resolve=False)
    try:
        resolved = _to_dict(cfg, resolve=True)
    except Exception as err:  # noqa: BLE001 - an interpolation or resolver error, reported as one line
        raise ConfigError("config", f"cannot be resolved: {_one_line(err)}", "valid ${...} interpolations") from None
    _check_top_level(cfg, resolved, raw)
    build_objects(cfg)


CHECKPOINT_KEYS = ("every_n_train_steps", "keep")


def check_resume(resume: Any) -> str:
    """``resume``: ``"auto"``, ``"never"`` or the path of a verified checkpoint file.

    A path must load with ``weights_only=True`` and, when it has a SHA-256 sidecar, match it
    (:func:`ddp_plugins.core.checkpoints.verify_checkpoint`): a file that is not a whole Lightning
    checkpoint is refused before anything of it runs. A checkpoint without a sidecar (one not
    written by :class:`~ddp_plugins.lightning.AtomicCheckpointIO`) is taken as given, unverified.

    Example::

        >>> check_resume("auto")
        'auto'
        >>> check_resume("no/such.ckpt")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `resume` should be ... got 'no/such.ckpt' (no such file).
    """
    from ddp_plugins.core.checkpoints import NO_DIGEST, verify_checkpoint

    allowed = "'auto', 'never' or the path of a checkpoint file"
    if not isinstance(resume, str):
        raise ArgumentTypeError("resume", allowed, resume)
    if resume in ("auto", "never"):
        return resume
    reason = verify_checkpoint(resume)
    if reason is None or reason.startswith(NO_DIGEST):  # no digest to check: taken unverified
        reason = None
        try:
            checkpoint_position(resume)
        except ValueError as err:
            reason = str(err)
    if reason is not None:
        raise ArgumentValueError("resume", allowed, problem=f"got {resume!r} ({reason})")
    return resume


def checkpoint_position(path: str | os.PathLike) -> tuple[int, int]:
    """(epoch, global step) of a Lightning checkpoint, loaded with ``weights_only=True`` (memory-mapped).

    Raises:
        ValueError: the file does not load that way or is not a Lightning checkpoint, as one line.
    """
    checkpoint = load_checkpoint_safely(path)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError("not a Lightning checkpoint (no state_dict)")
    return int(checkpoint.get("epoch", 0)), int(checkpoint.get("global_step", 0))


def load_checkpoint_safely(path: str | os.PathLike) -> Any:
    """``torch.load(path, weights_only=True)``, memory-mapped on the CPU; a refusal is a one-line ``ValueError``."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises many kinds; the caller reports one line
        first = _one_line(err).split(". ")[0][:200]
        raise ValueError(f"does not load with weights_only=True: {type(err).__name__}: {first}") from None


def _check_top_level(cfg: DictConfig, resolved: dict[str, Any], raw: dict[str, Any]) -> None:
    with _as_config_error("seed", raw):
        check_seed(resolved.get("seed"))
    with _as_config_error("deterministic", raw):
        check_bool("deterministic", resolved.get("deterministic"))
    with _as_config_error("global_batch_size", raw):
        check_int("global_batch_size", resolved.get("global_batch_size"), 1, allow_none=True)
    with _as_config_error("resume", raw):
        check_resume(resolved.get("resume", "auto"))
    checkpoint = resolved.get("checkpoint") or {}
    for key in checkpoint:
        if key not in CHECKPOINT_KEYS:
            raise ConfigError(f"checkpoint.{key}", "is not a key of the app's config", _choices(CHECKPOINT_KEYS))
    with _as_config_error("checkpoint.every_n_train_steps", raw):
        check_int("every_n_train_steps", checkpoint.get("every_n_train_steps", 0), 0)
    with _as_config_error("checkpoint.keep", raw):
        check_int("keep", checkpoint.get("keep", 2), 1)
    known = set(_groups()) | {"seed", "deterministic", "hydra", "resume", "checkpoint", "global_batch_size"}
    for key in resolved:
        if key not in known:
            raise ConfigError(key, "is not a key of the app's config", f"{_choices(sorted(known - {'hydra'}))}")
    env = (resolved.get("network") or {}).get("env") or {}
    if not isinstance(env, Mapping) or any(isinstance(v, (Mapping, list)) for v in env.values()):
        raise ConfigError("network.env", f"got {env!r}", "a mapping of environment variable names to values")
    trainer = resolved.get("trainer") or {}
    accelerator = str(trainer.get("accelerator", "auto"))
    with _as_config_error("backend", raw):
        check_backend(resolved["backend"]["name"], accelerator)
    resolve_precision(str(resolved["precision"]["name"]), accelerator)
    _check_trainer_args(trainer)
    _check_devices(trainer.get("devices", "auto"), accelerator)
    _check_global_batch(resolved.get("strategy") or {}, trainer)


def _check_global_batch(strategy: Mapping[str, Any], trainer: Mapping[str, Any]) -> None:
    """A global batch with fewer rows than ranks x micro-batches would leave every step partly empty."""
    g, devices, nodes = strategy.get("global_batch_size"), trainer.get("devices"), trainer.get("num_nodes", 1)
    accumulate = trainer.get("accumulate_grad_batches", 1)
    sizes = (g, devices, nodes, accumulate)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
        return  # null, "auto", or a type the strategy's own check names
    if g < devices * nodes * accumulate:
        raise ConfigError(
            "global_batch_size",
            f"got {g}, fewer rows than ranks x micro-batches ({devices * nodes} x {accumulate})",
            f"at least {devices * nodes * accumulate}",
        )


def build_objects(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate the configured strategy, callbacks, model, datamodule and ``Trainer``; start nothing.

    Each object is built from its own config node, so an error names the key it came from.

    Returns:
        ``{"strategy", "callbacks", "model", "datamodule", "trainer"}``.

    Raises:
        ConfigError: an object refused its configuration.
    """
    raw = OmegaConf.to_container(cfg, resolve=False)
    objects: dict[str, Any] = {"model": _build("model", cfg.model, raw), "datamodule": _build("data", cfg.data, raw)}
    objects["strategy"] = _build("strategy", cfg.strategy, raw)
    named = {
        f"callbacks.{name}": _build(f"callbacks.{name}", node, raw)
        for name, node in (cfg.get("callbacks") or {}).items()
        if node is not None
    }
    objects["callbacks"] = list(named.values())
    objects["trainer"] = _quiet_trainer(cfg, objects)
    for key, callback in named.items():  # the run-dependent checks their `setup` makes
        check = getattr(callback, "check_trainer", None)
        if check is not None:
            with _as_config_error(key, raw):
                check(objects["trainer"], objects["model"])
    return objects


def _build(key: str, node: Any, raw: Any) -> Any:
    """``hydra.utils.instantiate(node)``, its argument errors restated with ``key``."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    target = str(node.get("_target_", ""))
    cls = _import_target(key, target)
    params = _init_params(cls)
    if params is not None:
        for name in node:
            if name != "_target_" and not str(name).startswith("_") and name not in params:
                raise ConfigError(f"{key}.{name}", f"is not an argument of {cls.__name__}", _choices(sorted(params)))
    with _as_config_error(key, raw):
        try:
            return instantiate(node)
        except InstantiationException as err:
            cause = err.__cause__ or err
            raise cause from None


def _import_target(key: str, target: str) -> type:
    """The class ``target`` names (``pkg.module.Class``), or a one-line error on ``key._target_``."""
    module_name, _, attr = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(
            f"{key}._target_",
            f"got {target!r}, which cannot be imported ({_one_line(err)})",
            "an importable class path",
        ) from None
    if not isinstance(cls, type):
        raise ConfigError(f"{key}._target_", f"got {target!r}, which is not a class", "an importable class path")
    return cls


def _init_params(cls: type) -> set[str] | None:
    """The keyword arguments ``cls(...)`` takes, following ``**kwargs`` up the MRO; None when any are taken."""
    params: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        signature = inspect.signature(init)
        params |= {
            p.name
            for p in signature.parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"
        }
        if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            return params
        if klass.__module__.startswith(("lightning", "torch")):
            return None  # their **kwargs go to places we cannot list
    return params


@contextlib.contextmanager
def _as_config_error(prefix: str, raw: Any) -> Iterator[None]:
    """Restate an :class:`ArgumentError` raised in the body as a :class:`ConfigError` on ``prefix.<argument>``."""
    try:
        yield
    except ConfigError:
        raise
    except ArgumentError as err:
        key = prefix if prefix.endswith(f".{err.argument}") or prefix == err.argument else f"{prefix}.{err.argument}"
        raise ConfigError(_source_key(key, raw), err.problem, err.allowed) from None
    except (TypeError, ValueError) as err:
        raise ConfigError(prefix, f"was refused: {_one_line(err)}", "see the class's documentation") from None


def _source_key(key: str, raw: Any) -> str:
    """The key the value came from: ``callbacks.rank_aware_seed.seed`` is ``${seed}``, so ``seed``."""
    node = raw
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return key
        node = node[part]
    if isinstance(node, str) and node.startswith("${") and node.endswith("}") and node.count("${") == 1:
        return node[2:-1]
    return key


# --------------------------------------------------------------------------- the Trainer


def _trainer_hints() -> dict[str, Any]:
    from lightning.pytorch import Trainer

    hints = typing.get_type_hints(Trainer.__init__)
    hints.pop("return", None)
    return hints


def _check_trainer_args(trainer: Mapping[str, Any]) -> None:
    """Unknown ``trainer.*`` keys and values of the wrong type, from ``Trainer.__init__``'s annotations."""
    hints = _trainer_hints()
    allowed_keys = sorted(set(hints) - set(_APP_TRAINER_ARGS))
    for key, value in trainer.items():
        if key in _APP_TRAINER_ARGS:
            raise ConfigError(f"trainer.{key}", "is set by the app from its own config group", "; ".join(allowed_keys))
        if key not in hints:
            raise ConfigError(
                f"trainer.{key}", "is not an argument of lightning.pytorch.Trainer", ", ".join(allowed_keys)
            )
        if not _fits(value, hints[key]):
            raise ConfigError(f"trainer.{key}", f"got {value!r}", _describe_type(hints[key]))


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if origin in (list, tuple):
        return (
            isinstance(value, (list, tuple)) and all(_fits(v, args[0]) for v in value)
            if args
            else isinstance(value, (list, tuple))
        )
    if origin in (dict, Mapping):
        return isinstance(value, Mapping)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type):
        return isinstance(value, hint) or isinstance(value, (str, Mapping))  # objects arrive as names or configs
    return True


def _describe_type(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("NoneType", "None")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence Lightning's info lines and warnings while the throwaway Trainer is built."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _quiet_trainer(cfg: DictConfig, objects: dict[str, Any]) -> Any:
    """The run's ``Trainer`` without its logger or checkpoints: Lightning's own checks run, nothing starts."""
    from lightning.pytorch import Trainer

    trainer_args = _to_dict(cfg.trainer, resolve=True)
    accelerator = str(trainer_args.get("accelerator", "auto"))
    precision = resolve_precision(str(cfg.precision.name), accelerator)
    env_before = dict(os.environ)
    try:
        with _quiet():
            return Trainer(
                **trainer_args,
                strategy=objects["strategy"],
                precision=precision,
                callbacks=list(objects["callbacks"]),
                logger=False,
                enable_checkpointing=False,
            )
    except ConfigError:
        raise
    except ArgumentError as err:  # the strategy's checks; devices and num_nodes are the trainer's keys
        group = "trainer" if err.argument in trainer_args else "strategy"
        raise ConfigError(f"{group}.{err.argument}", err.problem, err.allowed) from None
    except Exception as err:  # noqa: BLE001 - Lightning raises several types; the message is what matters
        message = _one_line(err)
        key = next((k for k in trainer_args if k in message), None) or _culprit(trainer_args)
        where = f"trainer.{key}" if key else "trainer"
        got = f"got {trainer_args[key]!r}: " if key else ""
        raise ConfigError(where, f"{got}{message}", "what lightning.pytorch.Trainer accepts") from None
    finally:
        restore_env(env_before)


def _culprit(trainer_args: Mapping[str, Any]) -> str | None:
    """The one ``trainer.*`` argument that a Trainer refuses on its own, when Lightning's message names none."""
    from lightning.pytorch import Trainer

    try:
        with _quiet():
            Trainer(logger=False)
    except Exception:  # noqa: BLE001 - a Trainer without arguments refused too: the environment (Slurm's tasks)
        return None
    for key, value in trainer_args.items():
        try:
            with _quiet():
                Trainer(**{key: value}, accelerator=trainer_args.get("accelerator", "auto"), logger=False)
        except Exception:  # noqa: BLE001 - any refusal points at this key
            return key
    return "accelerator" if "accelerator" in trainer_args else None


# --------------------------------------------------------------------------- this machine


def _cuda_in_use(accelerator: str) -> bool:
    return accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())


def resolve_backend(backend: str, accelerator: str = "auto") -> str:
    """``auto`` -> ``nccl`` on CUDA, ``gloo`` otherwise; other names are checked and returned.

    Example::

        >>> resolve_backend("auto", "cpu")
        'gloo'
    """
    import torch.distributed as dist

    check_backend(backend, accelerator)
    if backend == "auto":
        return "nccl" if _cuda_in_use(accelerator) and dist.is_nccl_available() else "gloo"
    return backend


def resolve_precision(precision: str, accelerator: str = "auto") -> Precision:
    """``auto`` -> ``bf16-mixed`` on CUDA (when supported), ``32-true`` otherwise.

    Raises:
        ConfigError: an unknown precision, ``16-mixed`` on CPU, ``bf16-mixed`` on a GPU without it.

    Example::

        >>> resolve_precision("auto", "cpu")
        '32-true'
    """
    if precision not in PRECISIONS:
        raise ConfigError("precision", f"got {precision!r}", f"one of {_choices(PRECISIONS)}")
    cuda = _cuda_in_use(accelerator)
    if precision == "auto":
        return "bf16-mixed" if cuda and torch.cuda.is_bf16_supported() else "32-true"
    if precision == "16-mixed" and not cuda:
        raise ConfigError(
            "precision",
            "got '16-mixed', which needs CUDA (float16 autocast with a GradScaler) on a CPU run",
            "'32-true', 'bf16-mixed' or 'auto' on CPU",
        )
    if precision == "bf16-mixed" and cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision", "got 'bf16-mixed' on a GPU without bfloat16", "'16-mixed', '32-true' or 'auto'")
    return cast(Precision, precision)  # one of PRECISIONS, not "auto"


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
            if not devices or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < available for d in devices
            ):
                raise ConfigError(
                    "trainer.devices", f"got {list(devices)!r}", f"GPU indices between 0 and {available - 1}"
                )
            return
        if devices == -1:
            return
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError("trainer.devices", f"got {devices!r}", "a positive integer or 'auto'")
    if _cuda_in_use(accelerator):
        if devices > available:
            raise ConfigError(
                "trainer.devices", f"got {devices}, more GPUs than this machine has ({available})", f"1 to {available}"
            )
    elif devices > max_cpu_processes():
        raise ConfigError(
            "trainer.devices",
            f"got {devices}, more CPU processes than this machine runs well ({os.cpu_count()} cores)",
            f"1 to {max_cpu_processes()} ({CPU_PROCESSES_PER_CORE} per CPU core)",
        )
