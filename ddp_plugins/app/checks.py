"""The objects a composed config describes, built without starting anything; refusals as one :class:`ConfigError`."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import types
import typing
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from ddp_plugins.app.config import ConfigError, one_line, quoted_choices, resolve_precision, trainer_args
from ddp_plugins.core.checks import ArgumentError
from ddp_plugins.core.plan import GlobalPlan
from ddp_plugins.lightning import reproducible, tensorboard_logger
from ddp_plugins.lightning.network import restore_env

__all__ = ["APP_TRAINER_ARGS", "as_config_error", "build_objects", "check_trainer_args"]

# Trainer arguments the app sets from its own groups; `trainer.<these>` would clash.
APP_TRAINER_ARGS = ("strategy", "precision", "callbacks", "logger", "default_root_dir", "plugins")


def build_objects(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate every configured object and the ``Trainer``, each from its node (errors name it); start nothing."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    objects: dict[str, Any] = {"model": _build("model", cfg.model, raw), "datamodule": _build("data", cfg.data, raw)}
    objects["strategy"] = _build("strategy", cfg.strategy, raw)
    named = {
        f"callbacks.{name}": _build(f"callbacks.{name}", node, raw)
        for name, node in (cfg.get("callbacks") or {}).items()
        if node is not None
    }
    objects["callbacks"] = list(named.values())
    objects["logger"] = _build_logger(cfg.logger, raw)
    objects["trainer"] = _quiet_trainer(cfg, objects)
    for key, callback in named.items():  # the run-dependent checks their `setup` makes
        check = getattr(callback, "check_trainer", None)
        if check is not None:
            with as_config_error(key, raw):
                check(objects["trainer"], objects["model"])
    _check_global_batch_rows(objects["strategy"], objects["datamodule"])
    _check_reproducible(objects["strategy"], objects["datamodule"], objects["trainer"], objects["model"], raw)
    return objects


def _check_global_batch_rows(strategy: Any, datamodule: Any) -> None:
    """Refuse a global batch larger than the training data (not capped: it would silently not be the one used)."""
    size = getattr(strategy, "global_batch_size", None)
    rows = getattr(datamodule, "train_rows", None)  # the app's demo data know theirs without loading
    if isinstance(size, int) and isinstance(rows, int) and size > rows:
        raise ConfigError(
            "global_batch_size",
            f"got {size}, more than the {rows} training rows of the data (every epoch would be a single step)",
            f"at most {rows}, or more rows (data.*)",
        )


def _check_reproducible(strategy: Any, datamodule: Any, trainer: Any, model: Any, raw: Any) -> None:
    """The reproducible mode's limits that the strategy checks in the ranks, refused here first."""
    shards, rows = getattr(strategy, "virtual_shards", None), getattr(datamodule, "train_rows", None)
    if shards is None:
        return
    with as_config_error("trainer", raw):
        reproducible.check_trainer(trainer, trainer.world_size, shards)
    try:
        reproducible.check_deterministic(trainer)
    except ValueError:
        wanted = raw.get("deterministic") is True  # applied in each rank by callbacks.rank_aware_seed
        raise ConfigError(
            "deterministic",
            ("got true, but callbacks.rank_aware_seed, which applies it in each rank, is off:" if wanted else
             "got false, but") + " reproducible=true on CUDA needs deterministic kernels (others change the bits)",
            "true with reproducible=true on CUDA, and callbacks.rank_aware_seed on",
        ) from None  # fmt: skip
    if isinstance(rows, int):
        with as_config_error("global_batch_size", raw):
            drop_last = bool((raw.get("strategy") or {}).get("drop_last", False))
            plan = GlobalPlan(rows, strategy.global_batch_size, drop_last=drop_last, virtual_shards=shards)
        with as_config_error("strategy", raw):
            reproducible.check_shards(model, plan)


def _build_logger(node: Any, raw: Any) -> Any:
    """The ``logger`` group's logger (writing nothing yet); a TensorBoard writer that does not import is one line."""
    cls = _import_target("logger", node)
    problem = tensorboard_logger.writer_problem() if issubclass(cls, TensorBoardLogger) else None
    if problem is not None:
        raise ConfigError(
            "logger",
            f"got 'tensorboard', but {problem}",
            "'csv', or 'tensorboard' after `pip install 'ddp_plugins[tensorboard]'`",
        )
    return _build("logger", node, raw, save_dir=os.curdir)


def _build(key: str, node: Any, raw: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate(node, **kwargs)``, its argument errors restated with ``key``."""
    cls = _import_target(key, node)
    params = _init_params(cls)
    if params is not None:
        for name in node:
            if not str(name).startswith("_") and name not in params:
                allowed = quoted_choices(sorted(params))
                raise ConfigError(f"{key}.{name}", f"is not an argument of {cls.__name__}", allowed)
    with as_config_error(key, raw):
        try:
            return instantiate(node, **kwargs)
        except InstantiationException as err:
            raise (err.__cause__ or err) from None


def _import_target(key: str, node: Any) -> type:
    """The class ``node._target_`` names (``pkg.module.Class``), or a one-line error on ``key._target_``."""
    target = str(node.get("_target_", ""))
    module_name, _, attr = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        problem = f"got {target!r}, which cannot be imported ({one_line(err)})"
        raise ConfigError(f"{key}._target_", problem, "an importable class path") from None
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
        values = inspect.signature(init).parameters.values()
        params |= {p.name for p in values if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"}
        if not any(p.kind is p.VAR_KEYWORD for p in values):
            return params
        if klass.__module__.startswith(("lightning", "torch")):
            return None  # their **kwargs go to places we cannot list
    return params


@contextlib.contextmanager
def as_config_error(prefix: str, raw: Any) -> Iterator[None]:
    """Restate an :class:`ArgumentError` raised in the body as a :class:`ConfigError` on ``prefix.<argument>``."""
    try:
        yield
    except ConfigError:
        raise
    except ArgumentError as err:
        key = prefix if prefix.endswith(f".{err.argument}") or prefix == err.argument else f"{prefix}.{err.argument}"
        raise ConfigError(_source_key(key, raw), err.problem, err.allowed) from None
    except (TypeError, ValueError) as err:
        raise ConfigError(prefix, f"was refused: {one_line(err)}", "see the class's documentation") from None


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


def check_trainer_args(trainer: Mapping[str, Any]) -> None:
    """Unknown ``trainer.*`` keys and values of the wrong type, from ``Trainer.__init__``'s annotations."""
    hints = typing.get_type_hints(Trainer.__init__)
    hints.pop("return", None)
    allowed_keys = sorted(set(hints) - set(APP_TRAINER_ARGS))
    for key, value in trainer.items():
        if key in APP_TRAINER_ARGS:
            raise ConfigError(f"trainer.{key}", "is set by the app from its own config group", "; ".join(allowed_keys))
        if key not in hints:
            raise ConfigError(
                f"trainer.{key}", "is not an argument of lightning.pytorch.Trainer", ", ".join(allowed_keys)
            )
        if not _fits(value, hints[key]):
            described = str(hints[key]).replace("typing.", "").replace("NoneType", "None")
            raise ConfigError(f"trainer.{key}", f"got {value!r}", described)


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
        return isinstance(value, (list, tuple)) and (not args or all(_fits(v, args[0]) for v in value))
    if origin in (dict, Mapping):
        return isinstance(value, Mapping)
    if hint in (int, float):  # a bool is no number
        return isinstance(value, (int, hint)) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    if isinstance(hint, type):
        return isinstance(value, hint) or isinstance(value, (str, Mapping))  # objects arrive as names or configs
    return True


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
    args = trainer_args(cfg.trainer)
    accelerator = str(args.get("accelerator", "auto"))
    precision = resolve_precision(str(cfg.precision.name), accelerator, bool(cfg.get("reproducible")))
    env_before = dict(os.environ)
    try:
        with _quiet():
            return Trainer(
                **args,
                strategy=objects["strategy"],
                precision=precision,
                callbacks=list(objects["callbacks"]),
                logger=False,
                enable_checkpointing=False,
            )
    except ArgumentError as err:  # the strategy's checks; devices and num_nodes are the trainer's keys
        group = "trainer" if err.argument in args else "strategy"
        raise ConfigError(f"{group}.{err.argument}", err.problem, err.allowed) from None
    except Exception as err:  # noqa: BLE001 - Lightning raises several types; the message is what matters
        message = one_line(err)
        key = next((k for k in args if k in message), None) or _culprit(args)
        where = f"trainer.{key}" if key else "trainer"
        got = f"got {args[key]!r}: " if key else ""
        raise ConfigError(where, f"{got}{message}", "what lightning.pytorch.Trainer accepts") from None
    finally:
        restore_env(env_before)


def _culprit(args: Mapping[str, Any]) -> str | None:
    """The one ``trainer.*`` argument that a Trainer refuses on its own, when Lightning's message names none."""
    try:
        with _quiet():
            Trainer(logger=False)
    except Exception:  # noqa: BLE001 - a Trainer without arguments refused too: the environment (Slurm's tasks)
        return None
    for key, value in args.items():
        try:
            with _quiet():
                Trainer(**{key: value}, accelerator=args.get("accelerator", "auto"), logger=False)
        except Exception:  # noqa: BLE001 - any refusal points at this key
            return key
    return "accelerator" if "accelerator" in args else None
