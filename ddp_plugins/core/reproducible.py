"""The reproducible mode: the same bits on any number of ranks (plain torch).

A step of ``G`` rows is cut into ``V`` virtual shards that do not depend on the world size
(:meth:`GlobalPlan.shard_sizes <ddp_plugins.core.plan.GlobalPlan.shard_sizes>`); each rank runs
its shards one after another (:class:`ShardedStep`), so a shard's forward and backward see the
same rows, BatchNorm statistics and random numbers on every world size. What the shards give is
summed with :func:`exact_sum`, whose integer sums do not depend on how the shards are grouped.

Why by hand: torch's and Lightning's DDP sum gradients in float in the ring's order, so their
result depends on the world size; ``torch.use_deterministic_algorithms`` fixes the order at one
size only. The technique is Demmel and Nguyen's reproducible summation (ReproBLAS), simplified
to one exponent per tensor. Design and limits: docs/design.md ("The reproducible mode").
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddp_plugins._compat import BatchNormBase
from ddp_plugins.core.ranks import collective_device, is_distributed

__all__ = ["ShardedStep", "exact_sum", "fingerprint", "shard_seed"]

_BITS = 62  # |sum of all shards| < 2**63: each of up to 2**k shards gets 62 - k bits


def fingerprint(*states: Any) -> str:
    """A hash of the exact bytes of modules', optimizers' or state dicts' tensors (and their other values).

    Two runs with the same fingerprint hold the same bits: parameters, buffers and optimizer
    state, in the same order, dtypes and shapes.

    Example::

        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> b.load_state_dict(a.state_dict())
        <All keys matched successfully>
        >>> fingerprint(a) == fingerprint(b), len(fingerprint(a))
        (True, 32)
    """
    digest = hashlib.sha256()

    def feed(value: Any) -> None:
        if hasattr(value, "state_dict") and callable(value.state_dict):
            value = value.state_dict()
        if isinstance(value, Tensor):
            tensor = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"T{tensor.dtype}{tuple(value.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
        elif isinstance(value, Mapping):
            for key, item in value.items():
                digest.update(f"K{key!r}".encode())
                feed(item)
        elif isinstance(value, (list, tuple)):
            digest.update(f"L{len(value)}".encode())
            for item in value:
                feed(item)
        else:
            digest.update(f"V{value!r}".encode())

    for state in states:
        feed(state)
    return digest.hexdigest()[:32]


def shard_seed(seed: int, epoch: int, step: int, shard: int) -> int:
    """The seed of virtual shard ``shard`` of step ``step`` of ``epoch`` (the same on any rank).

    Example::

        >>> shard_seed(0, 0, 0, 1) != shard_seed(0, 0, 1, 0) != shard_seed(0, 1, 0, 0)
        True
    """
    key = f"{seed}/{epoch}/{step}/{shard}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _scaled(tensor: Tensor, power: int) -> Tensor:
    """``tensor * 2**power`` in float64, exact (two factors, so that neither overflows)."""
    half = power // 2
    return tensor.double() * 2.0**half * 2.0 ** (power - half)


def exact_sum(
    shards: Sequence[Sequence[Tensor | None]],
    like: Sequence[Tensor],
    weights: Sequence[float] | None = None,
    group: Any = None,
    bits: Sequence[Tensor] = (),
) -> tuple[list[Tensor | None], list[Tensor]]:
    """Sum ``weights[s] * shards[s][i]`` over this rank's shards ``s`` and all ranks, the same bits in any grouping.

    Each tensor ``i`` gets one exponent, agreed over all shards of all ranks (an ``all_reduce``
    of the largest magnitude); every value becomes an int64 of at most ``62 - ceil(log2(shards))``
    bits at that exponent, so the integer sums cannot overflow and are associative. A value
    smaller than ``2**-(62 - ceil(log2(shards)))`` of its tensor's largest is rounded to that
    grid (float32 keeps 24 bits). A tensor with a NaN or an infinity anywhere sums to NaN.

    Args:
        shards: per local shard, one tensor (or ``None``: no contribution) per entry of ``like``.
        like: the shapes and dtypes of the results.
        weights: a factor per shard, applied in float64 before rounding (``None``: 1).
        group: the process group (the default one; none at all runs on one process).
        bits: tensors whose float64 bits ride in the same ``all_reduce`` as a sum with zeros
            elsewhere: a tensor each rank fills only in its own slots comes back whole, bit-exact.

    Returns:
        The sums (``None`` where no shard of any rank gave a tensor), and ``bits`` reduced.

    Example (one process)::

        >>> x = [torch.tensor([0.1, 1e8]), torch.tensor([0.2, -1e8]), torch.tensor([0.3, 1.0])]
        >>> exact_sum([[t] for t in x], like=[x[0]])[0][0]
        tensor([0.6000, 1.0000])
    """
    weights = [1.0] * len(shards) if weights is None else list(weights)
    device = collective_device(group) if is_distributed() else torch.device("cpu")
    # the largest finite magnitude of each tensor (-1: absent), a non-finite flag each, the shard count
    top = torch.full((2 * len(like) + 1,), -1.0, dtype=torch.float64)
    top[len(like) : 2 * len(like)] = 0.0
    top[-1] = len(shards)
    for shard, weight in zip(shards, weights, strict=True):
        for i, tensor in enumerate(shard):
            if tensor is None:
                continue
            value = tensor.detach().double() * weight
            finite = torch.isfinite(value)
            top[i] = max(float(top[i]), float(value.abs().where(finite, 0.0).max()) if value.numel() else 0.0)
            top[len(like) + i] = max(float(top[len(like) + i]), float((~finite).any()))
    if is_distributed():
        top = top.to(device)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        total_shards = int(top[-1]) * dist.get_world_size(group)
        top = top.cpu()
    else:
        total_shards = len(shards)
    room = _BITS - max(0, math.ceil(math.log2(max(total_shards, 1))))
    powers = [room - math.frexp(float(m))[1] if m > 0 else 0 for m in top[: len(like)].tolist()]
    sizes = [t.numel() for t in like]
    ints = torch.zeros(sum(sizes), dtype=torch.int64)
    for shard, weight in zip(shards, weights, strict=True):
        parts = [
            torch.round(_scaled(t.detach().cpu().reshape(-1).double() * weight, p)).nan_to_num(0.0).to(torch.int64)
            if t is not None else torch.zeros(n, dtype=torch.int64)
            for t, p, n in zip(shard, powers, sizes, strict=True)
        ]  # fmt: skip
        if parts:
            ints += torch.cat(parts)
    extra = [b.detach().cpu().double().reshape(-1).view(torch.int64) for b in bits]
    payload = torch.cat([ints, *extra])
    if is_distributed():
        payload = payload.to(device)
        dist.all_reduce(payload, group=group)
        payload = payload.cpu()
    sums: list[Tensor | None] = []
    for i, (t, piece) in enumerate(zip(like, payload[: len(ints)].split(sizes), strict=True)):
        if float(top[i]) < 0:
            sums.append(None)
        elif float(top[len(like) + i]) > 0:
            sums.append(torch.full_like(t, math.nan))
        else:
            sums.append(_scaled(piece.double(), -powers[i]).to(t.dtype).reshape(t.shape).to(t.device))
    out_bits = [
        p.view(torch.float64).reshape(b.shape)
        for p, b in zip(payload[len(ints) :].split([e.numel() for e in extra]), bits, strict=True)
    ]
    return sums, out_bits


class _ShardStats:
    """The running statistics of a model's BatchNorm layers over the shards of one step.

    Before each shard the layers get the step's starting statistics back; after it, the shard's
    update ``new - (1 - momentum) * old`` (``momentum * batch statistic``) is kept. At the end
    the updates of all shards of all ranks are applied in shard order, ``x = (1 - momentum) * x
    + update``: one process running the shards one after another, the same bits on any split.
    """

    def __init__(self, module: nn.Module, virtual_shards: int) -> None:
        self.layers = [
            m for m in module.modules()
            if isinstance(m, BatchNormBase) and m.training and m.track_running_stats and m.running_mean is not None
        ]  # fmt: skip
        for layer in self.layers:
            if layer.momentum is None:
                raise ValueError(
                    f"reproducible mode: {type(layer).__name__} with momentum=None (a cumulative average) is not"
                    " supported; give it a momentum (0.1 is BatchNorm's default)."
                )
        self.shards = virtual_shards
        self.start = [(m.running_mean.clone(), m.running_var.clone()) for m in self.layers]  # type: ignore[union-attr]
        width = sum(2 * mean.numel() for mean, _ in self.start)
        self.updates = torch.zeros(virtual_shards, width, dtype=torch.float64)
        self.count = 0

    def before(self) -> None:
        for layer, (mean, var) in zip(self.layers, self.start, strict=True):
            layer.running_mean.copy_(mean)  # type: ignore[union-attr]
            layer.running_var.copy_(var)  # type: ignore[union-attr]

    def after(self, shard: int) -> None:
        parts = []
        for layer, (mean, var) in zip(self.layers, self.start, strict=True):
            keep = 1.0 - float(layer.momentum)  # type: ignore[arg-type]
            parts += [layer.running_mean - keep * mean, layer.running_var - keep * var]  # type: ignore[operator]
        if parts:
            self.updates[shard] = torch.cat([p.detach().cpu().double().reshape(-1) for p in parts])
        self.count += 1

    def apply(self, updates: Tensor) -> None:
        """Apply every shard's updates (all ranks', from the exchange) in shard order."""
        offset = 0
        for layer, (mean, var) in zip(self.layers, self.start, strict=True):
            keep = 1.0 - float(layer.momentum)  # type: ignore[arg-type]
            for buffer, first in ((layer.running_mean, mean), (layer.running_var, var)):
                n = first.numel()
                value = first.clone()
                for shard in range(self.shards):
                    value = keep * value + updates[shard, offset : offset + n].to(first.dtype).reshape(first.shape)
                buffer.copy_(value)  # type: ignore[union-attr]
                offset += n
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.sub_(self.count).add_(self.shards)


class ShardedStep:
    """One optimizer step run as virtual shards, reduced exactly: the same bits on any number of ranks.

    For each of this rank's shards, in order, run the forward and backward inside
    :meth:`shard`: the model's BatchNorm layers start from the step's statistics, the random
    streams (CPU, and CUDA where the model is) are seeded by :func:`shard_seed`, and the
    gradients are taken away afterwards. :meth:`finish` sums every shard of every rank with
    :func:`exact_sum`, weighted by rows (the gradient of the mean loss over the step's rows, as
    one process), applies the shards' BatchNorm updates in shard order, and returns the combined
    values; :meth:`apply` writes the gradients into ``.grad`` for the optimizer.

    Works from raw torch: no ``DistributedDataParallel`` wrapper takes part (its reducer would sum
    in float); the ranks' parameters start equal (broadcast them, or seed alike).

    Args:
        module: the model (its parameters that require a gradient are reduced).
        virtual_shards: ``V``, the shards of every step (the same on every run to compare).
        seed: the base of the shards' random streams.
        group: the process group (the default one).

    Example (one process, two shards of one step)::

        >>> model = torch.nn.Linear(3, 1)
        >>> x, step = torch.randn(4, 3), ShardedStep(model, virtual_shards=2)
        >>> for shard, rows in ((0, x[:2]), (1, x[2:])):
        ...     with step.shard(shard, rows=2, epoch=0, step=0):
        ...         model(rows).pow(2).mean().backward()
        >>> _ = step.finish(step_rows=4); step.apply(); model.weight.grad.shape
        torch.Size([1, 3])
    """

    def __init__(self, module: nn.Module, virtual_shards: int, seed: int = 0, group: Any = None) -> None:
        self.module = module
        self.virtual_shards = virtual_shards
        self.seed = seed
        self.group = group
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._grads: list[list[Tensor | None]] = []
        self._rows: list[int] = []
        self._stats: _ShardStats | None = None
        self.grads: list[Tensor | None] = []

    @contextmanager
    def shard(self, index: int, rows: int, epoch: int, step: int) -> Iterator[None]:
        """Run shard ``index`` (of ``rows`` rows) of ``step`` of ``epoch`` inside this block."""
        if self._stats is None:
            self._stats = _ShardStats(self.module, self.virtual_shards)
        self._stats.before()
        for p in self.params:  # the shard's own gradient only (the last step's is still there)
            p.grad = None
        cuda = [p.device for p in self.params[:1] if p.device.type == "cuda"]
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(shard_seed(self.seed, epoch, step, index))
            yield
        self._grads.append([p.grad.detach().clone() if p.grad is not None else None for p in self.params])
        for p in self.params:
            p.grad = None
        self._rows.append(rows)
        self._stats.after(index)

    def finish(self, step_rows: int, values: Sequence[Sequence[Tensor]] = ()) -> list[Tensor]:
        """Reduce the shards of all ranks; ``values[s]``: scalars of shard ``s`` to average by rows.

        Returns the row-weighted means of ``values`` over the step (the same on every rank).
        """
        assert self._stats is not None, "finish() before any shard()"
        stats, count = self._stats, len(self._grads)
        extra = [[v.detach().reshape(1) for v in shard] for shard in values] or [[] for _ in range(count)]
        like = [*self.params, *[torch.zeros(1, dtype=torch.float64) for _ in extra[0]]] if extra else [*self.params]
        shards = [grads + list(more) for grads, more in zip(self._grads, extra, strict=True)]
        sums, (updates,) = exact_sum(shards, like, weights=self._rows, group=self.group, bits=[stats.updates])
        stats.apply(updates)
        self.grads = [
            None if s is None else (s.double() / step_rows).to(p.dtype)
            for s, p in zip(sums[: len(self.params)], self.params, strict=True)
        ]
        means = [s.double() / step_rows for s in sums[len(self.params) :] if s is not None]
        self._grads, self._rows, self._stats = [], [], None
        return [m.reshape(()) for m in means]

    def apply(self) -> None:
        """Write the reduced gradients into the parameters' ``.grad``."""
        for p, grad in zip(self.params, self.grads, strict=True):
            p.grad = None if grad is None else grad.to(p.device)
