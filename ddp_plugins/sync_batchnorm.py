"""SyncBatchNorm on any device, with a conversion that keeps each layer's class and reverts exactly.

Why this is written by hand
---------------------------
``torch.nn.SyncBatchNorm`` only runs on GPUs: its kernels (``batch_norm_stats``,
``batch_norm_elemt``, ``batch_norm_backward_reduce``...) have no CPU implementation, so
``Trainer(sync_batchnorm=True)`` fails on CPU clusters, CI jobs and notebooks. Its conversion
replaces every ``_BatchNorm`` with a bare ``SyncBatchNorm`` (a subclass's own ``forward`` is lost,
BN-like classes outside ``_BatchNorm`` are skipped, frozen layers are converted anyway) and there is
no way back to the original classes (pytorch issue 41081).

Here the synchronized batch norm is a :class:`torch.autograd.Function` built from ops every device
has (sums, ``batch_norm`` with given statistics, ``native_batch_norm_backward``)
with ONE fused ``all_reduce`` in forward (per-channel sums, sums of squares and the count) and ONE in
backward (``sum(dy)`` and ``sum(dy * x_hat)``), so per-rank batch sizes may differ, down to 0. The
sums are formed from each rank's stable local mean and variance and reduced in float64, so the global
variance does not suffer from the cancellation of a naive ``E[x^2] - E[x]^2``. On CUDA with nccl it
delegates to torch's native kernel.

Conversion swaps each layer's class in place for a generated subclass that also derives from
:class:`SyncBatchNorm`, placed in the method resolution order right before ``_BatchNorm``: the
layer keeps its own ``forward``, attributes, hooks, parameters and buffers (the very same tensors),
and every ``super().forward(x)`` that reaches ``_BatchNorm.forward`` is synchronized. Reverting
restores the original class, so the round trip is bit-exact and ``state_dict`` keys never change.

Example::

    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    >>> model, report = convert_sync_batchnorm(model, return_report=True)
    >>> type(model[1]).__name__, isinstance(model[1], nn.BatchNorm2d), isinstance(model[1], SyncBatchNorm)
    ('SyncBatchNorm2d', True, True)
    >>> report.converted
    ['1']
    >>> type(revert_sync_batchnorm(model)[1]) is nn.BatchNorm2d
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

__all__ = [
    "SyncBatchNorm",
    "SyncBatchNormCallback",
    "SyncBatchNormPlugin",
    "SyncBatchNormReport",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
]

# What a layer must have for the synchronized forward (declared BN-like classes are checked).
_REQUIRED_ATTRIBUTES = (
    "num_features",
    "eps",
    "momentum",
    "affine",
    "track_running_stats",
    "weight",
    "bias",
    "running_mean",
    "running_var",
    "num_batches_tracked",
    "training",
)
# Attributes that conversion sets on a layer and revert removes (or restores).
_ADDED_ATTRIBUTES = ("process_group",)


class SyncBatchNorm(_BatchNorm):
    """Batch normalization synchronized over a process group, on any device and backend.

    The same semantics and ``state_dict`` keys as :class:`torch.nn.SyncBatchNorm`: in training the
    statistics are those of the global batch (per-rank batch sizes may differ, a rank may hold 0
    samples), running statistics are updated identically on every rank with the unbiased global
    variance (``momentum=None`` gives a cumulative average); in eval mode nothing is communicated.
    Inputs may be ``(N, C)`` or ``(N, C, *)`` of any rank, contiguous or channels_last. Without an
    initialized process group, or in a group of one, it is plain batch norm.

    One ``all_reduce`` per layer in forward and one in backward. On CUDA tensors with an nccl group
    it delegates to torch's native kernel. A rank must run backward through every synchronized
    layer whose forward it ran (as with torch's SyncBatchNorm), otherwise the others wait.

    Args:
        num_features: ``C`` of an input of size ``(N, C, *)``.
        eps: added to the variance for numerical stability.
        momentum: weight of the new batch in the running statistics; ``None`` for a cumulative
            average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running statistics (used in eval mode).
        process_group: the group to synchronize over; ``None`` means the whole world.
        device: device of the parameters and buffers.
        dtype: dtype of the parameters and buffers.
        bias: learn a bias when ``affine`` (``False`` keeps only the weight).

    Example::

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
        extra = {} if bias else {"bias": False}  # torch < 2.6 has no `bias` argument
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **extra)
        self.process_group = process_group

    @override
    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @override
    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        return _sync_batch_norm(self, input)


@dataclass
class SyncBatchNormReport:
    """What :func:`convert_sync_batchnorm` did: converted layer names, skipped names with reasons."""

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
    extra_classes: Sequence[type | str] | Mapping[type | str, str] = (),
    return_report: bool = False,
) -> nn.Module | tuple[nn.Module, SyncBatchNormReport]:
    """Synchronize every batch-norm layer of ``module`` in place, keeping each layer's class.

    Each ``_BatchNorm`` layer's class is swapped for a generated subclass of both its class and
    :class:`SyncBatchNorm` (``BatchNorm2d`` becomes ``SyncBatchNorm2d``, still an instance of
    ``BatchNorm2d``): the layer keeps its own ``forward``, attributes and hooks, and the
    normalization it reaches through ``super().forward`` is synchronized. Parameters and buffers
    are the same tensors. :func:`revert_sync_batchnorm` restores the original classes.

    BN-like classes that do not inherit ``_BatchNorm`` (or ``_BatchNorm`` subclasses that
    normalize without calling ``_BatchNorm.forward``) are declared through ``extra_classes``: the
    named method (``forward`` by default) is replaced by the synchronized batch norm of its single
    tensor argument, every other method is kept. Such a class must have the attributes of
    ``_BatchNorm``: ``num_features``, ``eps``, ``momentum``, ``affine``, ``track_running_stats``,
    ``weight``, ``bias``, ``running_mean``, ``running_var`` and ``num_batches_tracked``.

    Args:
        module: the model (or a single layer); converted in place and returned.
        process_group: the group to synchronize over; ``None`` means the whole world.
        group_size: synchronize within consecutive groups of this many ranks (for example the
            devices of one node) instead of the whole world; must divide the world size. Every rank
            must call the conversion (the groups are created collectively).
        skip_frozen: leave frozen layers alone: those in eval mode and those whose parameters
            all have ``requires_grad=False``.
        extra_classes: BN-like classes to convert as well: classes or import paths
            (``"pkg.module.Class"``), or a mapping from them to the name of the method to replace.
        return_report: also return a :class:`SyncBatchNormReport`.

    Returns:
        ``module``, or ``(module, report)`` with ``return_report=True``.

    Raises:
        ValueError: for an invalid argument, a declared class without what SyncBatchNorm needs, or a
            ``group_size`` that does not divide the world size.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` should be a torch.nn.Module, got {type(module).__name__}.")
    declared = _normalize_extra_classes(extra_classes)
    _check_args(process_group, group_size, skip_frozen)
    if group_size is not None:
        process_group = _new_group_of_size(group_size)

    report = SyncBatchNormReport()
    plan = []  # checked in full before any layer changes, so an error leaves the model untouched
    for name, layer in module.named_modules():
        name = name or type(layer).__name__
        method = _declared_method(type(layer), declared)
        if "_sync_batchnorm_original" in type(layer).__dict__ or (method is None and isinstance(layer, SyncBatchNorm)):
            report.skipped[name] = "already synchronized"
            continue
        if method is None and not isinstance(layer, _BatchNorm):
            continue
        missing = [a for a in _REQUIRED_ATTRIBUTES if not hasattr(layer, a)]
        if missing:
            raise ValueError(
                f"`extra_classes` declares {type(layer).__qualname__} as batch norm, but layer '{name}' lacks"
                f" what SyncBatchNorm needs: {', '.join(missing)}. Give the class the attributes of"
                " torch.nn.BatchNorm2d or remove it from `extra_classes`."
            )
        reason = _skip_reason(layer, skip_frozen)
        if reason:
            report.skipped[name] = reason
        else:
            plan.append((name, layer, method))
    for name, layer, method in plan:
        synced = _synced_class(type(layer), method)
        saved = {key: layer.__dict__[key] for key in _ADDED_ATTRIBUTES if key in layer.__dict__}
        layer.__class__ = synced
        layer.__dict__["process_group"] = process_group
        layer.__dict__["_sync_batchnorm_saved"] = saved
        report.converted.append(name)
    return (module, report) if return_report else module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Undo :func:`convert_sync_batchnorm` in place: every converted layer gets its original class back.

    Parameters, buffers and every other attribute are untouched, so the round trip is bit-exact.
    Layers that were not made by the conversion (including :class:`SyncBatchNorm` layers built
    directly) are left as they are.

    Args:
        module: the converted model (or layer).

    Returns:
        ``module``.
    """
    for layer in module.modules():
        original = type(layer).__dict__.get("_sync_batchnorm_original")
        if original is None:
            continue
        saved = layer.__dict__.pop("_sync_batchnorm_saved", {})
        for key in _ADDED_ATTRIBUTES:
            layer.__dict__.pop(key, None)
        layer.__dict__.update(saved)
        layer.__class__ = original
    return module


class SyncBatchNormPlugin(LayerSync):
    """Lightning ``LayerSync`` plugin: :func:`convert_sync_batchnorm` before DDP wraps the model, revert after.

    The strategy calls :meth:`apply` only when fitting and :meth:`revert` in its teardown. Pass it
    as ``Trainer(plugins=[SyncBatchNormPlugin()])`` (not together with ``sync_batchnorm=True``), or
    use :class:`SyncBatchNormCallback`.

    Args:
        process_group: the group to synchronize over; ``None`` means the whole world.
        group_size: synchronize within consecutive groups of this many ranks.
        skip_frozen: leave layers in eval mode or without trainable parameters alone.
        extra_classes: BN-like classes to convert as well (see :func:`convert_sync_batchnorm`).
    """

    def __init__(
        self,
        process_group: Any = None,
        group_size: int | None = None,
        skip_frozen: bool = True,
        extra_classes: Sequence[type | str] | Mapping[type | str, str] = (),
    ) -> None:
        _check_args(process_group, group_size, skip_frozen)
        self.process_group = process_group
        self.group_size = group_size
        self.skip_frozen = skip_frozen
        self.extra_classes = _normalize_extra_classes(extra_classes)
        self.report: SyncBatchNormReport | None = None

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        model, self.report = convert_sync_batchnorm(
            model,
            self.process_group,
            group_size=self.group_size,
            skip_frozen=self.skip_frozen,
            extra_classes=self.extra_classes,
            return_report=True,
        )
        rank_zero_info(str(self.report))
        return model

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)


class SyncBatchNormCallback(Callback):
    """Synchronize batch norm while fitting, on CPU or GPU: ``Trainer(callbacks=[SyncBatchNormCallback()])``.

    It installs a :class:`SyncBatchNormPlugin` in the parallel strategy (DDP, FSDP...), which
    converts the model after ``configure_model`` and before DDP wraps it, and reverts it to the
    original classes when fitting ends, so checkpoints (same keys) load into the original model.
    With a single-device strategy there is nothing to synchronize and it does nothing.

    Args:
        group_size: synchronize within consecutive groups of this many ranks (for example per
            node) instead of the whole world; must divide the world size.
        skip_frozen: leave layers in eval mode or without trainable parameters alone.
        extra_classes: BN-like classes to convert as well: classes or import paths, or a mapping
            from them to the method to replace (see :func:`convert_sync_batchnorm`).

    Raises:
        ValueError: for an invalid argument; in ``setup``, when the strategy already has another
            ``LayerSync`` plugin (``Trainer(sync_batchnorm=True)``) or ``group_size`` does not divide
            the world size.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[SyncBatchNormCallback()], accelerator="cpu", logger=False)
    """

    def __init__(
        self,
        group_size: int | None = None,
        skip_frozen: bool = True,
        extra_classes: Sequence[type | str] | Mapping[type | str, str] = (),
    ) -> None:
        self.plugin = SyncBatchNormPlugin(group_size=group_size, skip_frozen=skip_frozen, extra_classes=extra_classes)
        self._installed_in: Any = None

    @property
    def report(self) -> SyncBatchNormReport | None:
        """The report of the last conversion, ``None`` before fitting."""
        return self.plugin.report

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not hasattr(strategy, "_layer_sync"):
            rank_zero_info(f"SyncBatchNormCallback: {type(strategy).__name__} runs one device, nothing to synchronize.")
            return
        current = strategy._layer_sync
        if current is not None and current is not self.plugin:
            raise ValueError(
                f"`SyncBatchNormCallback` found the strategy already synchronizing layers with"
                f" {type(current).__name__} (`Trainer(sync_batchnorm=True)` or a LayerSync plugin). Use one of"
                " them: remove `sync_batchnorm=True` (it fails on CPU) or the callback."
            )
        _check_group_divides(self.plugin.group_size, trainer.world_size)
        strategy._layer_sync = self.plugin
        self._installed_in = strategy

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The strategy reverted the model in its own teardown (also after an exception, where this
        # hook is not called and the plugin stays installed, which `setup` accepts).
        self._uninstall()

    def _uninstall(self) -> None:
        if self._installed_in is not None and self._installed_in._layer_sync is self.plugin:
            self._installed_in._layer_sync = None
        self._installed_in = None


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over a process group: one all_reduce forward, one backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        process_group: Any,
    ) -> Tensor:
        channels = input.size(1)
        local = input.numel() // channels
        low_precision = input.dtype in (torch.float16, torch.bfloat16)
        stat_dtype = torch.float32 if low_precision else input.dtype
        acc_dtype = torch.float32 if input.device.type == "mps" else torch.float64  # mps has no float64
        # Fused payload [sum (C), sum of squares (C), count (1)], built from stable local stats.
        payload = torch.zeros(2 * channels + 1, dtype=acc_dtype, device=input.device)
        if local > 0:
            # Two passes (mean, then centered squares): stable, and on CPU faster than the fused stats kernel.
            x = input.float() if low_precision else input
            dims = [0, *range(2, input.dim())]
            mean = x.sum(dims) / local
            m2 = (x - mean.view(1, channels, *[1] * (input.dim() - 2))).square_().sum(dims)
            mean, m2 = mean.to(acc_dtype), m2.to(acc_dtype)
            payload[:channels] = mean * local
            payload[channels:-1] = m2 + mean * mean * local
            payload[-1] = local
        dist.all_reduce(payload, group=process_group)
        total = int(payload[-1].item())
        if total <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {total} over the process group"
            )
        mean = payload[:channels] / total
        var = (payload[channels:-1] / total - mean * mean).clamp_(min=0)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if running_var is not None:
                unbiased = var * (total / (total - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        mean, var = mean.to(stat_dtype), var.to(stat_dtype)
        if local > 0:
            output = F.batch_norm(input, mean, var, weight, bias, False, 0.0, eps)
        else:
            output = torch.empty_like(input)
        ctx.save_for_backward(input, weight, mean, var)
        ctx.eps, ctx.total, ctx.process_group = eps, total, process_group
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight, mean, var = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        channels = input.size(1)
        if input.numel() > 0:
            # Local sum(dy * x_hat) and sum(dy) in one fused kernel (eval mode: no batch terms).
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                grad_output, input, None, mean, var, None, None, False, ctx.eps, [False, True, True]
            )
        else:
            sum_dy_xhat = sum_dy = torch.zeros(channels, dtype=mean.dtype, device=input.device)
        # Weight and bias gradients stay local: DDP reduces them like every other gradient.
        grad_weight = sum_dy_xhat.to(weight.dtype) if need_weight and weight is not None else None
        grad_bias = sum_dy.to(weight.dtype if weight is not None else mean.dtype) if need_bias else None
        grad_input = None
        if need_input:
            payload = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(payload, group=ctx.process_group)
            if input.numel() > 0:
                mean_dy, mean_dy_xhat = (payload / ctx.total).split(channels)
                invstd = torch.rsqrt(var + ctx.eps)
                # grad_input = w * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)) = a*dy + b*x + c
                scale = invstd if weight is None else weight.to(invstd.dtype) * invstd
                coef_x = -scale * invstd * mean_dy_xhat
                shift = -scale * mean_dy - coef_x * mean
                ones, zeros = torch.ones_like(var), torch.zeros_like(mean)
                grad_input = F.batch_norm(grad_output, zeros, ones, scale, shift, False, 0.0, 0.0)
                shape = [1, channels] + [1] * (input.dim() - 2)
                grad_input.addcmul_(input, coef_x.view(shape))
            else:
                grad_input = torch.zeros_like(input)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _sync_batch_norm(layer: Any, input: Tensor) -> Tensor:
    """``_BatchNorm.forward`` with the statistics of the whole process group while training."""
    if input.dim() < 2:
        raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
    if input.size(1) == 0:
        raise ValueError("SyncBatchNorm number of input channels should be non-zero")
    factor = 0.0 if layer.momentum is None else layer.momentum
    if layer.training and layer.track_running_stats and layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)
        factor = 1.0 / float(layer.num_batches_tracked) if layer.momentum is None else layer.momentum
    bn_training = layer.training or (layer.running_mean is None and layer.running_var is None)
    tracked = not layer.training or layer.track_running_stats
    running_mean = layer.running_mean if tracked else None
    running_var = layer.running_var if tracked else None

    group = getattr(layer, "process_group", None)
    world_size = 1
    if bn_training and layer.training and dist.is_available() and dist.is_initialized():
        group = group if group is not None else dist.group.WORLD
        world_size = dist.get_world_size(group)
    if world_size == 1:  # eval mode, no process group or a group of one: plain batch norm
        return F.batch_norm(
            input, running_mean, running_var, layer.weight, layer.bias, bn_training, factor, layer.eps
        )
    if input.is_cuda and dist.get_backend(group) == "nccl":  # torch's native kernel is faster there
        from torch.nn.modules._functions import SyncBatchNorm as _TorchSyncBatchNormFunction

        return _TorchSyncBatchNormFunction.apply(
            input, layer.weight, layer.bias, running_mean, running_var, layer.eps, factor, group, world_size
        )
    return _SyncBatchNormFunction.apply(
        input, layer.weight, layer.bias, running_mean, running_var, layer.eps, factor, group
    )


def _declared_forward(self: Any, input: Tensor) -> Tensor:
    return _sync_batch_norm(self, input)


_SYNCED_CLASSES: dict[tuple[type, str | None], type] = {}


def _synced_class(original: type, method: str | None) -> type:
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
            namespace[method] = _declared_forward
            bases: tuple[type, ...] = (original,)
        elif issubclass(original, nn.SyncBatchNorm):  # its forward bypasses _BatchNorm.forward
            bases = (SyncBatchNorm, original)
        else:  # SyncBatchNorm lands right before _BatchNorm in the MRO
            bases = (original, SyncBatchNorm)
        _SYNCED_CLASSES[key] = type(original)(name, bases, namespace)
    return _SYNCED_CLASSES[key]


def _new_synced(original: type, method: str | None) -> nn.Module:
    """Unpickle (and deepcopy) a converted layer: rebuild its generated class first."""
    cls = _synced_class(original, method)
    return cls.__new__(cls)


def _skip_reason(layer: nn.Module, skip_frozen: bool) -> str | None:
    lazy = isinstance(layer, nn.modules.lazy.LazyModuleMixin) and layer.has_uninitialized_params()
    if lazy:
        return "uninitialized lazy module: run one forward first"
    if not skip_frozen:
        return None
    if not layer.training:
        return "frozen: eval mode"
    params = list(layer.parameters(recurse=False))
    if params and not any(p.requires_grad for p in params):
        return "frozen: no trainable parameters"
    return None


def _declared_method(cls: type, declared: Mapping[type, str]) -> str | None:
    for base in cls.__mro__:
        if base in declared:
            return declared[base]
    return None


def _normalize_extra_classes(extra: Any) -> dict[type, str]:
    if isinstance(extra, (str, type)):
        extra = [extra]
    if isinstance(extra, Mapping):
        items = list(extra.items())
    elif isinstance(extra, Sequence) or extra is None:
        items = [(entry, "forward") for entry in (extra or ())]
    else:
        raise ValueError(
            "`extra_classes` should be a list of classes or import paths, or a mapping from them to a method"
            f" name, got {type(extra).__name__}."
        )
    declared: dict[type, str] = {}
    for entry, method in items:
        cls = _import_class(entry) if isinstance(entry, str) else entry
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"`extra_classes` should hold torch.nn.Module classes, got {entry!r}.")
        if not isinstance(method, str) or not callable(getattr(cls, method, None)):
            raise ValueError(
                f"`extra_classes` names method {method!r} of {cls.__qualname__}, which it does not have."
                " Name the method that normalizes its single tensor argument, such as 'forward'."
            )
        declared[cls] = method
    return declared


def _import_class(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"`extra_classes` entry {path!r} cannot be imported: {err}.") from None


def _check_args(process_group: Any, group_size: Any, skip_frozen: Any) -> None:
    """The argument checks shared by :func:`convert_sync_batchnorm` and :class:`SyncBatchNormPlugin`."""
    if not isinstance(skip_frozen, bool):
        raise ValueError(f"`skip_frozen` should be True or False, got {skip_frozen!r}.")
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"`group_size` should be a positive integer or None, got {group_size!r}.")
    if process_group is not None:
        raise ValueError("`process_group` and `group_size` should not both be set, got both.")


def _check_group_divides(group_size: int | None, world_size: int) -> None:
    if group_size is not None and world_size % group_size:
        raise ValueError(f"`group_size` should divide the world size {world_size}, got {group_size}.")


def _new_group_of_size(group_size: int) -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"`group_size` needs an initialized process group, got group_size={group_size} without one."
        )
    world_size = dist.get_world_size()
    _check_group_divides(group_size, world_size)
    if group_size == world_size:
        return None
    group, _ = dist.new_subgroups(group_size=group_size)
    return group
