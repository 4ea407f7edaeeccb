"""The reproducible mode: the same bits on any number of ranks (plain torch).

Each rank runs its virtual shards one after another (:class:`ShardedStep`); :func:`exact_sum` sums them as integers.
By hand: DDP sums floats in the ring's order. See docs/design.md, "The reproducible mode".
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddp_plugins._compat import BatchNormBase
from ddp_plugins.core.ranks import collective_device, is_distributed
from ddp_plugins.core.seeding import MAX_SEED, collect_rng_states, set_rng_states

__all__ = ["LayoutMismatch", "RowSums", "ShardedStep", "exact_row_sum", "exact_sum", "fingerprint", "shard_seed"]

_BITS = 52  # |sum of all shards| < 2**53 (float64 holds every such integer): 2**k shards get 52 - k bits


def fingerprint(*states: Any) -> str:
    """A hash of the exact bytes of modules', optimizers' or state dicts' tensors (and their other values).

    Example::

        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> b.load_state_dict(a.state_dict())
        <All keys matched successfully>
        >>> fingerprint(a) == fingerprint(b), len(fingerprint(a))
        (True, 32)
    """
    digest = hashlib.sha256()

    def feed(value: Any) -> None:
        if callable(getattr(value, "state_dict", None)):
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


def _flat64(tensors: Iterable[Tensor], device: torch.device | str | None = None) -> Tensor:
    """The tensors laid end to end as one float64 row, on their device (``device`` for none)."""
    pieces = [t.detach().double().reshape(-1) for t in tensors]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64, device=device)


def exact_sum(
    shards: Sequence[Sequence[Tensor | None]],
    like: Sequence[Tensor],
    weights: Sequence[float] | None = None,
    group: Any = None,
    bits: Sequence[Tensor] = (),
    total_shards: int | None = None,
) -> tuple[list[Tensor | None], list[Tensor]]:
    """Sum ``weights[s] * shards[s][i]`` over this rank's shards ``s`` and all ranks, the same bits in any grouping.

    One exponent per tensor, agreed by the ranks (docs/design.md, "The reproducible mode"); a NaN or inf sums to NaN.

    Args:
        shards: per local shard, one tensor (or ``None``: no contribution) per entry of ``like``.
        like: the shapes and dtypes of the results.
        weights: a factor per shard, applied in float64 before rounding (``None``: 1).
        group: the process group (the default one; none at all runs on one process).
        bits: float64 tensors summed plainly in the same ``all_reduce`` (bit-exact where each rank fills its own slots).
        total_shards: the most non-zero-weight shards of all ranks; sets the grid: a plan's ``V``, never the ranks'
            count (``None``: counted, one more ``all_reduce``).

    Returns:
        The sums (``None`` where no shard of any rank gave a tensor), and ``bits`` reduced.

    Raises:
        ValueError: the ranks gave more than ``total_shards`` shards in all.

    Example (one process)::

        >>> x = [torch.tensor([0.1, 1e8]), torch.tensor([0.2, -1e8]), torch.tensor([0.3, 1.0])]
        >>> exact_sum([[t] for t in x], like=[x[0]])[0][0]
        tensor([0.6000, 1.0000])
    """
    sizes = [t.numel() for t in like]
    device = next((t.device for shard in shards for t in shard if t is not None), torch.device("cpu"))
    zeros = [torch.zeros(n, dtype=torch.float64, device=device) for n in sizes]
    laid = [_flat64([z if t is None else t for t, z in zip(shard, zeros, strict=True)]) for shard in shards]
    rows = torch.stack(laid) if laid else torch.zeros(0, sum(sizes), dtype=torch.float64, device=device)
    present = torch.tensor([any(shard[i] is not None for shard in shards) for i in range(len(like))], dtype=torch.bool)
    weights = [1.0] * len(shards) if weights is None else [float(w) for w in weights]
    if total_shards is None:
        count = torch.tensor([float(sum(w != 0 for w in weights))], dtype=torch.float64)
        total_shards = int(_all_reduce(count, collective_device(group), group).item())
    summed = exact_row_sum(rows, weights, sizes, present, total_shards, group=group, bits=bits)
    sums: list[Tensor | None] = [
        piece.to(t.dtype).reshape(t.shape).to(t.device) if there else None
        for piece, t, there in zip(summed.sums.split(sizes), like, summed.present.tolist(), strict=True)
    ]
    return sums, summed.bits


def exact_row_sum(
    rows: Tensor,
    weights: Sequence[float],
    sizes: Sequence[int],
    present: Tensor,
    total_shards: int,
    *,
    group: Any = None,
    bits: Sequence[Tensor] = (),
    maxima: Tensor | None = None,
    workspace: dict[str, Tensor] | None = None,
    layout: float | None = None,
) -> RowSums:
    """:func:`exact_sum` of ``weights[s] * rows[s]`` (``rows``: a flat row per local shard, its tensors end to end).

    ``sizes``: the tensors' lengths; ``present``: the tensors this rank gave; ``maxima``: each row's largest magnitude
    per tensor, if kept; ``workspace``: keeps the large buffers (and results) to the next call; ``layout``: an integer
    below ``2**52`` naming what the rows hold, else :class:`LayoutMismatch` on every rank. The sum runs on the rows'
    device; :meth:`Grid.of`, :meth:`Grid.integers`, :meth:`Grid.values` are pure, an ``all_reduce`` between each.
    """
    device = collective_device(group)  # the CPU without a process group
    extra = () if layout is None else (layout, -layout)  # its maximum and minus its minimum: equal if all gave the same
    mine = Grid.of(rows, weights, sizes, present, maxima, extra)
    grid = Grid(_all_reduce(mine.packed, device, group, dist.ReduceOp.MAX).cpu(), sizes)  # every rank's, combined
    if extra:
        most, least = grid.extra.tolist()
        if most != -least:
            raise LayoutMismatch(f"the ranks' rows hold different tensors (layouts {-least:.0f} to {most:.0f})")
    total, bit_sizes = sum(sizes), [b.numel() for b in bits]
    work = {} if workspace is None else workspace
    payload = _scratch(work, "payload", total + 1 + sum(bit_sizes), rows.device)
    grid.integers(rows, weights, total_shards, payload[:total], _scratch(work, "scaled", total, rows.device))
    payload[total] = float(sum(w != 0 for w in weights))
    for piece, b in zip(payload[total + 1 :].split(bit_sizes), bits, strict=True):
        piece.copy_(b.reshape(-1))
    payload = _all_reduce(payload, device, group)
    if payload[total] > total_shards:
        raise ValueError(
            f"exact_sum: the ranks gave {int(payload[total])} shards of non-zero weight in all, more than"
            f" total_shards={total_shards} that set the rounding grid; pass the real bound (the same on any number"
            " of ranks)."
        )
    out_bits = [p.reshape(b.shape) for p, b in zip(payload[total + 1 :].split(bit_sizes), bits, strict=True)]
    return RowSums(grid.values(payload[:total], total_shards), grid.present, out_bits)


class RowSums(NamedTuple):
    """:func:`exact_row_sum`'s float64 sums (laid out as the rows), the tensors any rank gave, ``bits`` reduced."""

    sums: Tensor
    present: Tensor
    bits: list[Tensor]  # float64, on the rows' device


class LayoutMismatch(ValueError):
    """:func:`exact_row_sum`'s ranks gave different ``layout`` numbers (raised on every rank alike)."""


def _scratch(workspace: dict[str, Tensor], name: str, size: int, device: torch.device) -> Tensor:
    """A float64 buffer of ``size`` kept in ``workspace`` from call to call (allocated once, not per step)."""
    buffer = workspace.get(name)
    if buffer is None or buffer.numel() < size or buffer.device != device:
        buffer = workspace[name] = torch.empty(size, dtype=torch.float64, device=device)
    return buffer[:size]


def _all_reduce(tensor: Tensor, device: torch.device, group: Any, op: Any = dist.ReduceOp.SUM) -> Tensor:
    """``tensor`` reduced over the ranks (as it is without a process group), back on its own device."""
    if not is_distributed():
        return tensor
    moved = tensor.to(device)
    dist.all_reduce(moved, op=op, group=group)
    return moved.to(tensor.device)


def _largest(t: Tensor) -> Tensor:
    """The largest magnitude in ``t`` (NaN if it holds one; 0 when empty), without a copy of it."""
    if not t.numel():
        return t.new_zeros(())
    low, high = torch.aminmax(t)
    return torch.maximum(-low, high)


def _row_maxima(rows: Tensor, sizes: Sequence[int]) -> Tensor:
    """Per row and tensor, its largest magnitude: ``[rows, tensors]`` (contiguous slices, one reduction each)."""
    if not len(rows):
        return torch.zeros(0, len(sizes), dtype=rows.dtype, device=rows.device)
    return torch.stack([torch.stack([_largest(t) for t in row.split(list(sizes))]) for row in rows])


class Grid:
    """Each tensor's rounding grid in one float64 vector, combined by ``all_reduce(MAX)``: ``maxima`` (largest finite
    ``|weight * value|``; -1: absent), ``nonfinite`` flags, then ``extra``. :meth:`of` builds one rank's."""

    def __init__(self, packed: Tensor, sizes: Sequence[int]) -> None:
        self.packed, self.sizes, n = packed, list(sizes), len(sizes)
        self.maxima, self.nonfinite, self.extra = packed[:n], packed[n : 2 * n], packed[2 * n :]

    @property
    def present(self) -> Tensor:
        """Which tensors some rank gave."""
        return self.maxima >= 0

    @classmethod
    def of(
        cls, rows: Tensor, weights: Sequence[float], sizes: Sequence[int], present: Tensor,
        maxima: Tensor | None = None, extra: Sequence[float] = (),
    ) -> Grid:  # fmt: skip
        """One rank's grid of ``weights[s] * rows[s]`` (``maxima``: :func:`_row_maxima` of ``rows``, if kept)."""
        grid = cls(torch.zeros(2 * len(sizes) + len(extra), dtype=torch.float64, device=rows.device), sizes)
        top = grid.maxima
        if len(rows):
            w = torch.tensor([float(x) for x in weights], dtype=torch.float64, device=rows.device)
            maxima = _row_maxima(rows, sizes) if maxima is None else maxima
            top[:] = (maxima.double() * w[:, None]).amax(dim=0)  # |w * x| = w * |x| exactly: w is a row count
            if not bool(torch.isfinite(top).all()):  # rare: find the tensors, keep the finite maxima
                finite = torch.isfinite(rows)
                grid.nonfinite[:] = torch.stack([(~f).any() for f in finite.split(grid.sizes, dim=1)]).double()
                top[:] = (_row_maxima(rows.where(finite, 0.0), sizes).double() * w[:, None]).amax(dim=0)
        top[:] = top.where(present.to(rows.device), -1.0)
        if extra:
            grid.extra[:] = grid.packed.new_tensor(extra)
        return grid

    def exponents(self, total_shards: int) -> list[int]:
        """Each tensor's scale ``2**e``: its largest magnitude times ``total_shards`` stays below ``2**53``.

        ``|e| <= 900``: ``2**e`` times a row count and ``2**-e`` stay normal (below ``2**-850``: fewer bits, any N)."""
        room = _BITS - max(0, math.ceil(math.log2(max(total_shards, 1))))
        return [min(max(room - math.frexp(m)[1], -900), 900) if m > 0 else 0 for m in self.maxima.tolist()]

    def integers(
        self, rows: Tensor, weights: Sequence[float], total_shards: int, out: Tensor | None = None,
        scaled: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """One rank's rows summed on the combined grid: float64 integers, exact in any order (``scaled``: scratch)."""
        exponents, flags = self.exponents(total_shards), any(self.nonfinite.tolist())
        sums = torch.empty(sum(self.sizes), dtype=torch.float64, device=rows.device) if out is None else out
        scaled = torch.empty_like(sums) if scaled is None else scaled
        sums.zero_()
        for row, weight in zip(rows, weights, strict=True):
            scaled.copy_(row)  # widened to float64: exact
            for t, e, size in zip(scaled.split(self.sizes), exponents, self.sizes, strict=True):
                if size:  # one rounding of x * w * 2**e (w * 2**e is exact): none for a float32 x and a row count w
                    t.mul_(float(weight) * 2.0**e)
            if flags:
                scaled.nan_to_num_(0.0, 0.0, 0.0)
            sums += scaled.round_()  # integers below 2**53 in float64: exact, in any order and grouping
        return sums

    def values(self, sums: Tensor, total_shards: int) -> Tensor:
        """The ranks' :meth:`integers`, summed, back at their tensors' scale in place (NaN where one was not finite)."""
        exponents, flags = self.exponents(total_shards), self.nonfinite.tolist()
        for t, e, bad in zip(sums.split(self.sizes), exponents, flags, strict=True):
            t.fill_(math.nan) if bad else t.mul_(2.0**-e)  # in place, exact: a power of two
        return sums


class _ShardStats:
    """BatchNorm running statistics over a step's shards: each starts from the step's, updates applied in order."""

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
        self.buffers: list[Tensor] = [b for m in self.layers for b in (m.running_mean, m.running_var) if b is not None]
        self.start = [b.detach().clone() for b in self.buffers]
        device = self.buffers[0].device if self.buffers else None
        self.first = _flat64(self.start, device)
        self.keep = _flat64(
            (torch.full((2 * m.num_features,), 1.0 - float(m.momentum or 0.0), device=device) for m in self.layers),
            device,
        )
        self.updates = torch.zeros(virtual_shards, len(self.first), dtype=torch.float64, device=device)

    def before(self) -> None:
        for buffer, start in zip(self.buffers, self.start, strict=True):
            buffer.copy_(start)

    def after(self, shard: int) -> None:
        # + 0.0: a -0.0 becomes +0.0, so that the exchange (a sum with zeros) keeps every bit
        self.updates[shard] = _flat64(self.buffers, self.first.device) - self.keep * self.first + 0.0

    def apply(self, updates: Tensor, local_shards: int) -> None:
        """Apply every shard's updates (all ranks', from the exchange) in shard order; ``local_shards``: this rank's."""
        value = self.first.clone()
        for update in updates:
            value = self.keep * value + update
        for buffer, piece in zip(self.buffers, value.split([b.numel() for b in self.buffers]), strict=True):
            buffer.copy_(piece.reshape(buffer.shape))
        for layer in self.layers:
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.sub_(local_shards).add_(len(updates))


class ShardedStep:
    """One optimizer step run as virtual shards, reduced exactly: the same bits on any number of ranks.

    Run each shard's forward and backward in :meth:`shard`; :meth:`finish` sums all ranks' shards exactly, by rows;
    :meth:`apply` sets ``.grad`` of the parameters requiring one at the step's start. No DDP wrapper (its reducer
    sums floats); the parameters start equal. See docs/design.md, "The reproducible mode".

    Args:
        module: the model.
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
        self.module, self.virtual_shards, self.seed, self.group = module, virtual_shards, seed, group
        named = list(module.named_parameters())
        self._names = [name for name, _ in named]
        self._all = [p for _, p in named]  # every parameter; those that do not train this step take no room
        self._trainable: tuple[bool, ...] = ()  # which of them require a gradient this step
        self._layout = 0.0  # a number for that choice, agreed by the ranks in each step's first all_reduce
        self.params: list[Tensor] = []  # the parameters this step trains (requires_grad when it started)
        self.changed: tuple[list[str], list[str]] | None = None  # (started, stopped) training at the last step
        self._sizes: list[int] = []  # per parameter, its values in a shard's row (0: not trained this step)
        self._offsets: list[int] = [0]
        self._block = torch.zeros(0, 0)  # the shards' gradients, one flat row each; the logged values after them
        self._out: list[Tensor | None] = [None] * len(self._all)  # the reduced gradients, kept from step to step
        self._lay_out(tuple(p.requires_grad for p in self._all))
        cuda = {p.device for p in self._all if p.device.type == "cuda"}
        self._generators = [torch.default_generator, *(torch.cuda.default_generators[d.index or 0] for d in cuda)]
        self._rng: tuple[dict[str, Any], list[Tensor]] | None = None  # the streams before the step, given back
        self._buffers: list[tuple[str, Tensor, Tensor]] = []  # (name, buffer, its value at the step's start)
        self._rows: list[int] = []  # the rows of this rank's shards of the step, in order
        self._maxima: list[Tensor] = []  # per shard, each gradient's largest magnitude
        self._work: dict[str, Tensor] = {}  # the exact sum's large buffers, kept from step to step
        self._stats: _ShardStats | None = None
        self.grads: list[Tensor | None] = []  # per parameter of the module (None: none reduced)

    def _lay_out(self, trainable: tuple[bool, ...]) -> None:
        """Lay the shards' rows out for the parameters in ``trainable`` (at a step's start, on every rank alike)."""
        before, self._trainable = self._trainable, trainable
        if before:
            self.changed = (
                [n for n, now, was in zip(self._names, trainable, before, strict=True) if now and not was],
                [n for n, now, was in zip(self._names, trainable, before, strict=True) if was and not now],
            )
        self.params = [p for p, t in zip(self._all, trainable, strict=True) if t]
        self._sizes = [p.numel() if t else 0 for p, t in zip(self._all, trainable, strict=True)]
        self._offsets = list(itertools.accumulate(self._sizes, initial=0))
        self._present = [False] * len(self._all)
        self._out = [out if t else None for out, t in zip(self._out, trainable, strict=True)]
        digest = hashlib.blake2b(bytes(trainable), digest_size=8).digest()
        self._layout = float(int.from_bytes(digest, "little") >> 12)  # 52 bits: exact in float64
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in self.params), torch.float32)
        device = self.params[0].device if self.params else torch.device("cpu")
        if self._block.dtype != dtype or self._block.device != device:
            self._block = torch.zeros(0, self._offsets[-1], dtype=dtype, device=device)

    @contextmanager
    def shard(self, index: int, rows: int, epoch: int, step: int) -> Iterator[None]:
        """Run shard ``index`` (of ``rows`` rows) of ``step`` of ``epoch`` inside this block."""
        if self._stats is None:
            trainable = tuple(p.requires_grad for p in self._all)
            self.changed = None
            if trainable != self._trainable:  # a layer unfrozen or frozen since the last step: from this one on
                named = list(self.module.named_parameters())
                if len(named) != len(self._all) or any(p is not q for (_, p), q in zip(named, self._all, strict=False)):
                    raise ValueError(
                        f"reproducible mode: the model's parameters changed between steps (now {len(named)}, were"
                        f" {len(self._all)}); add or replace parameters before fit starts (configure_model), not"
                        " during it."
                    )
                self._lay_out(trainable)
            self._stats = _ShardStats(self.module, self.virtual_shards)
            # Python's, NumPy's and torch's CPU stream, and the model's CUDA ones: given back in finish()
            self._rng = (collect_rng_states(include_cuda=False), [g.get_state() for g in self._generators[1:]])
            normalized = {id(b) for m in self._stats.layers for b in m.buffers(recurse=False)}
            self._buffers = [
                (name, b, b.detach().clone()) for name, b in self.module.named_buffers() if id(b) not in normalized
            ]
        self._stats.before()
        for p in self.params:  # the shard's own gradient only (the last step's is still there)
            p.grad = None
        seed = shard_seed(self.seed, epoch, step, index)
        for generator in self._generators:  # every stream a shard may draw from: torch's, Python's and NumPy's
            generator.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % (MAX_SEED + 1))
        yield
        k, width = len(self._rows), self._offsets[-1]
        row = self._room(k + 1, width)[k, :width]
        for i, p in enumerate(self._all):  # copied into the shard's row where they are: no host copy
            if not self._sizes[i]:
                continue
            piece = row[self._offsets[i] : self._offsets[i + 1]]
            if p.grad is None:
                piece.zero_()
            else:
                piece.copy_(p.grad.detach().reshape(-1))
                self._present[i] = True
            p.grad = None
        self._maxima.append(torch.stack([_largest(t) for t in row.split(self._sizes)]))
        self._rows.append(rows)
        self._stats.after(index)

    def _room(self, rows: int, width: int) -> Tensor:
        """The block, with room for ``rows`` shards of ``width`` values (grown, never shrunk, keeping its values)."""
        have_rows, have_width = self._block.shape
        if rows > have_rows or width > have_width:
            grown = self._block.new_zeros(max(rows, have_rows), max(width, have_width))
            grown[:have_rows, :have_width] = self._block
            self._block = grown
        return self._block

    def finish(self, step_rows: int, values: Sequence[Sequence[Tensor]] = ()) -> list[Tensor]:
        """Reduce the shards of all ranks; ``values[s]``: scalars of shard ``s`` to average by rows.

        Returns the row-weighted means of ``values`` over the step (the same on every rank).
        """
        assert self._stats is not None, "finish() before any shard()"
        for name, buffer, start in self._buffers:  # once a step, not a shard: each check waits for a GPU
            if not torch.equal(buffer, start):
                raise ValueError(
                    f"reproducible mode: the forward updated buffer {name!r}, which each rank would update from its own"
                    " shards only, so the bits would depend on the number of ranks. Make it a BatchNorm (combined"
                    " in shard order), a parameter, or update it outside training_step."
                )
        now = tuple(p.requires_grad for p in self._all)
        if now != self._trainable:  # the rows of this step's shards hold the parameters it started with
            moved = [n for n, a, b in zip(self._names, now, self._trainable, strict=True) if a != b]
            raise ValueError(
                f"reproducible mode: requires_grad of {', '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}"
                " changed inside a training step, whose shards were laid out for the parameters it started with."
                " Freeze or unfreeze between steps (a callback's on_train_batch_start or on_train_epoch_start,"
                " as BackboneFinetuning does)."
            )
        if self._rng is not None:  # restored once a step, not per shard
            host, cuda = self._rng
            set_rng_states(host)
            for generator, state in zip(self._generators[1:], cuda, strict=True):
                generator.set_state(state)
        stats, local = self._stats, len(self._rows)
        count, width = len(values[0]) if values else 0, self._offsets[-1]
        block = self._room(local, width + count)[:local, : width + count]  # the scalars after the gradients
        sizes = self._sizes + [1] * count
        present = torch.tensor(self._present + [True] * count)
        maxima = torch.stack(self._maxima)
        if count:  # the shards' scalars ride after their gradients (a device copy, no host sync)
            block[:, width:] = torch.stack([torch.stack([v.detach().reshape(()) for v in shard]) for shard in values])
            maxima = torch.cat([maxima, block[:, width:].abs().to(maxima)], dim=1)
        try:
            summed = exact_row_sum(
                block, self._rows, sizes, present, self.virtual_shards, group=self.group, bits=[stats.updates],
                maxima=maxima, workspace=self._work, layout=self._layout,
            )  # fmt: skip
        except LayoutMismatch:
            trained = [n for n, t in zip(self._names, self._trainable, strict=True) if t]
            raise ValueError(
                f"reproducible mode: the ranks train different parameters in this step (this rank {len(trained)}:"
                f" {', '.join(trained[:3])}{' ...' if len(trained) > 3 else ''}), so their gradients cannot be summed."
                " Freeze and unfreeze alike on every rank, at the same step (a callback, not rank-dependent code)."
            ) from None
        stats.apply(summed.bits[0], local_shards=local)
        pieces = summed.sums.div_(step_rows).split(sizes)
        self.grads = []
        for i, (piece, p, there) in enumerate(zip(pieces, self._all, summed.present.tolist(), strict=False)):
            if there and self._sizes[i]:
                out = self._out[i]
                if out is None:  # the reduced gradients' own tensors, kept from step to step
                    out = self._out[i] = torch.empty_like(p)
                self.grads.append(out.copy_(piece.view(p.shape)))
            else:
                self.grads.append(None)
        self._rows, self._maxima, self._stats, self._present = [], [], None, [False] * len(self._all)
        return [piece.reshape(()).clone() for piece in pieces[len(self._all) :]]

    def apply(self) -> None:
        """Write the reduced gradients into the ``.grad`` of the parameters this step trained."""
        for p, grad, trained in zip(self._all, self.grads, self._trainable, strict=True):
            if trained:
                p.grad = grad  # on the parameter's device already
