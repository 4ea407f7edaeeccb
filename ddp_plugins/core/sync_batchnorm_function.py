"""The synchronized batch-norm autograd function
===============================================

:class:`SyncBatchNormFunction`, built from ops every device has, and :func:`sync_batch_norm`, the
``_BatchNorm.forward`` that uses it. Plain torch.
"""

from __future__ import annotations

from typing import Any, overload

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ddp_plugins import _compat

__all__ = ["SyncBatchNormFunction", "sync_batch_norm"]


@overload
def _upcast(tensor: Tensor, dtype: torch.dtype) -> Tensor: ...
@overload
def _upcast(tensor: Tensor | None, dtype: torch.dtype) -> Tensor | None: ...
def _upcast(tensor: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``tensor`` in ``dtype`` when it is a lower-precision float (float16, bfloat16), else as it is."""
    if tensor is None or tensor.dtype not in (torch.float16, torch.bfloat16):
        return tensor
    return tensor.to(dtype)


class SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over a process group: one all_reduce forward, one backward.

    Built from sums, ``batch_norm`` with given statistics and ``native_batch_norm_backward``, so it
    runs on every device. Forward all-reduces the per-channel sums, sums of squares and the count
    in one tensor, backward ``sum(dy)`` and ``sum(dy * x_hat)``: per-rank batch sizes may differ,
    down to 0. float16 and bfloat16 inputs are normalized in float32 and returned in their own dtype.

    Example::

        >>> # SyncBatchNormFunction.apply(x, weight, bias, running_mean, running_var, eps, momentum, group)
        >>> issubclass(SyncBatchNormFunction, torch.autograd.Function)
        True
    """

    @staticmethod
    def forward(
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
            # float16/bfloat16: normalize in float32 (as the plain layer's CPU kernel does), output in the input's dtype
            output = F.batch_norm(
                _upcast(input, stat_dtype),
                mean,
                var,
                _upcast(weight, stat_dtype),
                _upcast(bias, stat_dtype),
                False,
                0.0,
                eps,
            ).to(input.dtype)
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
        input_dtype = input.dtype
        input, grad_output = _upcast(input, mean.dtype), _upcast(grad_output, mean.dtype)
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
                grad_input = grad_input.addcmul_(input, coef_x.view(shape)).to(input_dtype)
            else:
                grad_input = torch.zeros_like(input, dtype=input_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def sync_batch_norm(layer: Any, input: Tensor) -> Tensor:
    """``_BatchNorm.forward`` with the statistics of the whole process group while training.

    Example::

        >>> from torch import nn
        >>> x = torch.randn(8, 3, 5)
        >>> layer, plain = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
        >>> torch.allclose(sync_batch_norm(layer, x), plain(x))  # no process group: plain batch norm
        True
        >>> torch.allclose(layer.running_mean, plain.running_mean), int(layer.num_batches_tracked)
        (True, 1)
    """
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
        return F.batch_norm(input, running_mean, running_var, layer.weight, layer.bias, bn_training, factor, layer.eps)
    if input.is_cuda and dist.get_backend(group) == "nccl":  # torch's native kernel is faster there
        return _compat.TorchSyncBatchNormFunction.apply(
            input, layer.weight, layer.bias, running_mean, running_var, layer.eps, factor, group, world_size
        )
    return SyncBatchNormFunction.apply(
        input, layer.weight, layer.bias, running_mean, running_var, layer.eps, factor, group
    )
