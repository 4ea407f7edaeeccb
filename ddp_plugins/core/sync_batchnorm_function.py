"""The synchronized batch-norm autograd function, and the ``_BatchNorm.forward`` that uses it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ddp_plugins import _compat
from ddp_plugins.core.ranks import for_collective, is_distributed

__all__ = ["SyncBatchNormFunction", "sync_batch_norm"]


class SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over a process group, on every device: one all_reduce forward, one backward.

    By hand: torch's SyncBatchNorm kernels have no CPU implementation (docs/design.md, "Synchronized batch norm on
    any device"). Per-rank batch sizes may differ, down to 0; float16 and bfloat16 are normalized in float32.

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
        stat_dtype = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
        acc_dtype = torch.float32 if input.device.type == "mps" else torch.float64  # mps has no float64
        shape = (1, channels) + (1,) * (input.dim() - 2)
        x = input.to(stat_dtype)  # float16/bfloat16: normalized in float32
        # Fused payload [sum (C), sum of squares (C), count (1)], built from stable local stats.
        if local > 0:
            # Two passes; the centered values go into the buffer that becomes the output (no other
            # input-sized temporary: on CPU that costs as much as the arithmetic; faster than var_mean)
            dims = [0, *range(2, input.dim())]
            sums = x.sum(dims)
            out = torch.sub(x, (sums / local).view(shape))
            payload = torch.cat([sums, out.square_().sum(dims), sums.new_zeros(1)]).to(acc_dtype)
            local_sums = payload[:channels]
            payload[channels:-1].addcmul_(local_sums, local_sums, value=1.0 / local)  # + n * mean^2
            payload[-1] = local
        else:
            payload = torch.zeros(2 * channels + 1, dtype=acc_dtype, device=input.device)
        payload = for_collective(payload, process_group)
        dist.all_reduce(payload, group=process_group)
        payload = payload.to(input.device)
        total = payload[-1]  # a tensor: no host synchronization (torch.compile keeps one graph)
        ctx.eps, ctx.process_group = eps, process_group
        if local <= 1:  # only then can the group hold fewer than 2 values per channel: read it to say so
            if int(total) == 0:  # empty on every rank: as torch's batch norm, an empty output, no statistics
                ctx.save_for_backward(input, weight, payload.new_zeros(5, channels).to(stat_dtype), total)
                return torch.empty_like(input)
            _check_count(int(total))
        moments = payload[:-1].view(2, channels) / total
        mean = moments[0]
        var = torch.addcmul(moments[1], mean, mean, value=-1).clamp_(min=0)
        if running_mean is not None:  # in-place ops cast the float64 statistics to the buffers' dtype
            running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        if running_var is not None:  # unbiased; addcmul_ by a 0-dim factor rounds as add_(alpha=factor) does
            running_var.mul_(1 - momentum).addcmul_(var, momentum * total / (total - 1))
        # y = x * scale + shift per channel (as the native kernel applies given statistics)
        invstd = (var + eps).rsqrt_()
        scale = invstd if weight is None else invstd * weight
        shift = (mean * scale).neg_() if bias is None else torch.addcmul(bias, mean, scale, value=-1)
        # rows: mean, var, scale, scale * invstd (backward's coefficient of x), shift
        coefs = torch.stack([mean, var, scale, scale * invstd, shift]).to(stat_dtype)
        ctx.save_for_backward(input, weight, coefs, total)
        if local == 0:
            return torch.empty_like(input)
        affine = coefs[2:].view(3, *shape)
        return torch.mul(x, affine[0], out=out).add_(affine[2]).to(input.dtype)  # float16/bfloat16: back from float32

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight, coefs, total = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        input_dtype, stat_dtype = input.dtype, coefs.dtype
        input, grad_output = input.to(stat_dtype), grad_output.to(stat_dtype)  # float16/bfloat16: in float32
        channels = input.size(1)
        mean = coefs[0]
        if input.numel() > 0:
            # Local sum(dy * x_hat) and sum(dy) in one eval-mode kernel, as a unit weight's and a bias's
            # gradients; CUDA's needs the weight and empty save_mean/save_invstd (None fails on an H100).
            unit, empty = torch.ones_like(mean), mean.new_empty(0)
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                grad_output, input, unit, mean, coefs[1], empty, empty, False, ctx.eps, [False, True, True]
            )
        else:
            sum_dy_xhat = sum_dy = torch.zeros(channels, dtype=stat_dtype, device=input.device)
        # Weight and bias gradients stay local: DDP reduces them like every other gradient.
        param_dtype = stat_dtype if weight is None else weight.dtype
        grad_weight = grad_bias = grad_input = None
        if need_weight and weight is not None:
            grad_weight = sum_dy_xhat.to(param_dtype)
        if need_bias:
            grad_bias = sum_dy.to(param_dtype)
        if need_input:
            payload = for_collective(torch.cat([sum_dy, sum_dy_xhat]), ctx.process_group)
            dist.all_reduce(payload, group=ctx.process_group)
            payload = payload.to(grad_output.device)
            if input.numel() > 0:
                # grad_input = w * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)) = scale*dy + coef_x*x + shift
                # rows of terms: -scale * mean(dy), coef_x = -scale * invstd * mean(dy * x_hat)
                terms = coefs[2:4] * (payload / -total).view(2, channels)
                shift = torch.addcmul(terms[0], terms[1], mean, value=-1)
                shape = (1, channels) + (1,) * (input.dim() - 2)
                grad_input = torch.mul(grad_output, coefs[2].view(shape))
                grad_input = grad_input.addcmul_(input, terms[1].view(shape)).add_(shift.view(shape)).to(input_dtype)
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
    running_mean, running_var = (layer.running_mean, layer.running_var) if tracked else (None, None)

    group = getattr(layer, "process_group", None)
    world_size = 1
    if bn_training and layer.training and is_distributed():
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


def _check_count(total: int) -> None:
    """Refuse a group with one value per channel (a variance needs two), on every rank alike (zero is allowed)."""
    if total <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {total} over the process group")
