"""Batch norm synchronized over a process group on any device; a conversion that keeps classes and reverts."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from ddp_plugins import _compat
from ddp_plugins._compat import BatchNormBase as _BatchNorm
from ddp_plugins.core.checks import ArgumentTypeError, ArgumentValueError, check_bool, check_int
from ddp_plugins.core.ranks import is_distributed
from ddp_plugins.core.sync_batchnorm_function import sync_batch_norm

__all__ = [
    "SyncBatchNorm",
    "SyncBatchNormReport",
    "check_sync_batchnorm_args",
    "check_group_divides",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
]

# What a layer must have for the synchronized forward (declared BN-like classes are checked).
_REQUIRED_ATTRIBUTES = (
    *"num_features eps momentum affine track_running_stats weight bias".split(),
    *"running_mean running_var num_batches_tracked training".split(),
)


class SyncBatchNorm(_BatchNorm):
    """Batch normalization synchronized over a process group, on any device and backend.

    By hand: :class:`torch.nn.SyncBatchNorm` runs on accelerators only. Its arguments, semantics and ``state_dict``
    keys, plus ``bias`` (``False``: weight only); per-rank batches may be empty; in a group of one: plain batch norm.

    Example::

        >>> import torch
        >>> layer = SyncBatchNorm(3)
        >>> layer(torch.randn(4, 3, 5)).shape  # no process group: plain batch norm
        torch.Size([4, 3, 5])
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
    ) -> None:
        if not _compat.BATCHNORM_TAKES_BIAS and not bias:
            raise ArgumentValueError("bias", f"True on torch {torch.__version__} (`bias=False` needs torch 2.13)", bias)
        bias_kwarg = {"bias": bias} if _compat.BATCHNORM_TAKES_BIAS else {}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **bias_kwarg)
        self.process_group = process_group

    @override
    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @override
    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        return _sync_batch_norm(self, input)


# eager inside a compiled model where dynamo mistraces it (``_compat.DYNAMO_TRACES_SYNCBN``): a graph break there
_sync_batch_norm = sync_batch_norm if _compat.DYNAMO_TRACES_SYNCBN else torch.compiler.disable(sync_batch_norm)


@dataclass
class SyncBatchNormReport:
    """What :func:`convert_sync_batchnorm` did: converted layer names, skipped names with reasons.

    Example::

        >>> from torch import nn
        >>> _, report = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3).eval()), return_report=True)
        >>> report.converted, report.skipped
        ([], {'0': 'frozen: eval mode'})
    """

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        text = f"SyncBatchNorm: converted {len(self.converted)} layer(s)"
        if self.skipped:
            text += f", skipped {len(self.skipped)}: " + ", ".join(f"{k} ({v})" for k, v in self.skipped.items())
        return text


def convert_sync_batchnorm(
    module: nn.Module,
    process_group: Any = None,
    *,
    group_size: int | None = None,
    skip_frozen: bool = True,
    extra_classes: Sequence[type | str] | Mapping[Any, str] = (),
    return_report: bool = False,
) -> Any:  # `module`, or `(module, report)` with return_report=True
    """Synchronize every batch-norm layer of ``module`` in place: ``BatchNorm2d`` becomes ``SyncBatchNorm2d``,
    a generated subclass of it and :class:`SyncBatchNorm` that keeps its ``forward``, attributes, hooks and tensors.

    By hand: torch's conversion drops a subclass's ``forward`` and cannot revert (docs/design.md,
    "Synchronized batch norm on any device").

    Args:
        module: the model (or a single layer); converted in place and returned.
        process_group: the group to synchronize over; ``None`` means the whole world.
        group_size: synchronize within consecutive groups of this many ranks, a divisor of the world size
            (then every rank must call the conversion).
        skip_frozen: leave layers in eval mode or without trainable parameters alone.
        extra_classes: BN-like classes (with ``_BatchNorm``'s attributes) or import paths to convert too, or a
            mapping from them to the name of the method to replace.
        return_report: return ``(module, SyncBatchNormReport)``.

    Raises:
        ValueError: a bad argument, a declared class lacking what SyncBatchNorm needs, a ``group_size`` not a divisor.

    Example::

        >>> from torch import nn
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        >>> model, report = convert_sync_batchnorm(model, return_report=True)
        >>> type(model[1]).__name__, isinstance(model[1], nn.BatchNorm2d), isinstance(model[1], SyncBatchNorm)
        ('SyncBatchNorm2d', True, True)
        >>> report.converted
        ['1']
    """
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError("module", "a torch.nn.Module", problem=f"got {type(module).__name__}")
    declared = normalize_extra_classes(extra_classes)
    check_sync_batchnorm_args(process_group, group_size, skip_frozen)
    if group_size is not None:
        if not is_distributed():
            raise ValueError(
                f"`group_size` needs an initialized process group, got group_size={group_size} without one."
            )
        world_size = dist.get_world_size()
        check_group_divides(group_size, world_size)
        process_group = None if group_size == world_size else dist.new_subgroups(group_size=group_size)[0]

    report = SyncBatchNormReport()
    plan = []  # checked in full before any layer changes, so an error leaves the model untouched
    for name, layer in module.named_modules():
        name = name or type(layer).__name__
        method = next((declared[base] for base in type(layer).__mro__ if base in declared), None)
        if "_sync_batchnorm_original" in type(layer).__dict__ or (method is None and isinstance(layer, SyncBatchNorm)):
            report.skipped[name] = "already synchronized"
            continue
        if method is None and not isinstance(layer, _BatchNorm):
            continue
        if missing := [a for a in _REQUIRED_ATTRIBUTES if not hasattr(layer, a)]:
            raise ValueError(
                f"`extra_classes` declares {type(layer).__qualname__} as batch norm, but layer '{name}' lacks"
                f" what SyncBatchNorm needs: {', '.join(missing)}. Give the class the attributes of"
                " torch.nn.BatchNorm2d or remove it from `extra_classes`."
            )
        if reason := _skip_reason(layer, skip_frozen):
            report.skipped[name] = reason
        else:
            plan.append((name, layer, method))
    for name, layer, method in plan:
        saved = {"process_group": layer.__dict__["process_group"]} if "process_group" in layer.__dict__ else {}
        layer.__class__ = _synced_class(type(layer), method)
        layer.__dict__["process_group"] = process_group
        layer.__dict__["_sync_batchnorm_saved"] = saved
        report.converted.append(name)
    return (module, report) if return_report else module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Undo :func:`convert_sync_batchnorm` in place, bit-exactly: converted layers get their class back.

    Example::

        >>> from torch import nn
        >>> net = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)))
        >>> type(revert_sync_batchnorm(net)[0]) is nn.BatchNorm1d
        True
    """
    for layer in module.modules():
        original = type(layer).__dict__.get("_sync_batchnorm_original")
        if original is not None:
            saved = layer.__dict__.pop("_sync_batchnorm_saved", {})
            layer.__dict__.pop("process_group", None)
            layer.__dict__.update(saved)
            layer.__class__ = original
    return module


_SYNCED_CLASSES: dict[tuple[type, str | None], type[nn.Module]] = {}


def _synced_class(original: type, method: str | None) -> type[nn.Module]:
    """The generated class of a converted layer, cached so every layer of a class shares it."""
    key = (original, method)
    if key not in _SYNCED_CLASSES:
        name = original.__name__ if original.__name__.startswith("Sync") else f"Sync{original.__name__}"
        namespace: dict[str, Any] = {
            "__module__": original.__module__,
            "__qualname__": name,
            "_sync_batchnorm_original": original,
            "__reduce_ex__": lambda self, protocol: (_new_synced, (original, method), self.__getstate__()),
        }
        if method is not None:  # declared class: replace its normalizing method
            namespace[method] = _sync_batch_norm  # called as a method: sync_batch_norm(layer, input)
            bases: tuple[type, ...] = (original,)
        elif issubclass(original, nn.SyncBatchNorm):  # its forward bypasses _BatchNorm.forward
            bases = (SyncBatchNorm, original)
        else:  # SyncBatchNorm lands right before _BatchNorm in the MRO
            bases = (original, SyncBatchNorm)
        _SYNCED_CLASSES[key] = type(original)(name, bases, namespace)  # the original's metaclass
    return _SYNCED_CLASSES[key]


def _new_synced(original: type, method: str | None) -> nn.Module:
    """Unpickle (and deepcopy) a converted layer: rebuild its generated class first."""
    cls = _synced_class(original, method)
    return cls.__new__(cls)


def _skip_reason(layer: nn.Module, skip_frozen: bool) -> str | None:
    if isinstance(layer, nn.modules.lazy.LazyModuleMixin) and layer.has_uninitialized_params():
        return "uninitialized lazy module: run one forward first"
    if skip_frozen and not layer.training:
        return "frozen: eval mode"
    params = list(layer.parameters(recurse=False))
    if skip_frozen and params and not any(p.requires_grad for p in params):
        return "frozen: no trainable parameters"
    return None


def normalize_extra_classes(extra: Any) -> dict[type, str]:
    """``extra_classes`` of :func:`convert_sync_batchnorm` as ``{class: method name}``, each entry checked.

    Raises:
        ArgumentTypeError: not a list or mapping of classes or import paths.
        ArgumentValueError: an entry that cannot be imported, is not a module class, or lacks the method.
    """
    if isinstance(extra, (str, type)):
        extra = [extra]
    if isinstance(extra, Mapping):
        items = list(extra.items())
    elif isinstance(extra, Sequence) or extra is None:
        items = [(entry, "forward") for entry in (extra or ())]
    else:
        allowed = "a list of classes or import paths, or a mapping from them to a method name"
        raise ArgumentTypeError("extra_classes", allowed, problem=f"got {type(extra).__name__}")
    declared: dict[type, str] = {}
    for entry, method in items:
        cls = entry
        if isinstance(entry, str):
            module_name, _, attr = entry.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError, ValueError) as err:
                problem = f"got {entry!r}, which cannot be imported ({err})"
                raise ArgumentValueError("extra_classes", "importable classes", problem=problem) from None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ArgumentValueError("extra_classes", "torch.nn.Module classes or their import paths", entry)
        if not isinstance(method, str) or not callable(getattr(cls, method, None)):
            allowed = (
                f"the name of a method of {cls.__qualname__} that normalizes its tensor argument, such as 'forward'"
            )
            raise ArgumentValueError("extra_classes", allowed, method)
        declared[cls] = method
    return declared


def check_sync_batchnorm_args(process_group: Any, group_size: Any, skip_frozen: Any) -> None:
    """The argument checks of :func:`convert_sync_batchnorm`, shared with the Lightning plugin and callback."""
    check_bool("skip_frozen", skip_frozen)
    check_int("group_size", group_size, 1, allow_none=True)
    if group_size is not None and process_group is not None:
        raise ArgumentValueError(
            "group_size", "None when `process_group` is given", group_size, hint="Give one of the two."
        )


def check_group_divides(group_size: int | None, world_size: int) -> None:
    """Check that groups of ``group_size`` ranks tile a world of ``world_size`` ranks.

    Example::

        >>> check_group_divides(3, 2)
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `group_size` should be a divisor of the world size 2, got 3.
    """
    if group_size is not None and world_size % group_size:
        raise ArgumentValueError("group_size", f"a divisor of the world size {world_size}", group_size)
