"""Every rank's rows gathered in rank order, whatever each rank holds, and the row helpers of step outputs."""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ddp_plugins.core.checks import check_int, check_number
from ddp_plugins.core.ranks import collective_device, is_distributed
from ddp_plugins.core.timeline import collective_kind
from ddp_plugins.core.trees import tree_leaves, tree_map

__all__ = ["concat_batches", "distributed_concat", "num_rows", "truncate_rows"]


def distributed_concat(
    data: Any,
    num_total_examples: int | None = None,
    *,
    pad_value: float | None = None,
    group: Any = None,
    local_error: str | None = None,
) -> Any:
    """All-gather ``data`` from every rank, concatenate along dim 0 in rank order, truncate.

    ``data`` is a tensor, a list of Python rows (ids, strings, tensor-free dicts or tuples), or a nested dict /
    tuple / list of those; ranks may hold different numbers of rows, even none; all get the result, on its devices.
    By hand: torchmetrics' ``gather_all_tensors`` takes one tensor, and the core imports no torchmetrics
    (docs/design.md, "Exact distributed evaluation"). The protocol: above ``_FITS``.

    Args:
        num_total_examples: keep the first this many rows (drops a :class:`SequentialDistributedSampler`'s padding).
        pad_value: pad tensors whose trailing dimensions differ across ranks with this; ``None``: they raise.
        local_error: a failure this rank found preparing ``data`` (then ignored), raised by every rank together.

    Raises:
        ValueError: structures, dtypes or trailing shapes differ across ranks (raised on every rank).
        TypeError: ``data`` holds something that is neither a tensor, a container nor a list of rows.

    Example::

        >>> distributed_concat({"preds": torch.arange(4), "ids": ["a", "b", "c", "d"]}, 3)
        {'preds': tensor([0, 1, 2]), 'ids': ['a', 'b', 'c']}
    """
    error = local_error
    check_int("num_total_examples", num_total_examples, 0, allow_none=True)
    check_number("pad_value", pad_value, allow_none=True)
    spec: Any = None
    leaves: list[tuple[str, Any]] = []
    if error is None:
        try:
            spec, leaves = _flatten(data)
        except TypeError as exc:
            error = str(exc)
    world = dist.get_world_size(group) if is_distributed() else 1
    if world > 1:
        with collective_kind("gather", "distributed_concat"):
            outs = _gather_tensors(spec, leaves, error, pad_value, group, world)
            if outs is None:  # Python rows, a local error or ranks that disagree: every rank's full metadata
                outs = _gather_with_metadata(spec, leaves, error, pad_value, group)
    else:
        if error is not None:
            raise ValueError(error)
        _check_consistent([_RankMeta(spec, [_describe(leaf) for _, leaf in leaves], [])], leaves, pad_value)
        outs = [list(leaf) if _is_rows(leaf) else leaf for _, leaf in leaves]
    result = _unflatten(data, iter(outs))
    return result if num_total_examples is None else truncate_rows(result, num_total_examples)


def _is_rows(value: Any) -> bool:
    """A list of Python objects, one per row: scalars, strings, or dicts/tuples without tensors."""
    return isinstance(value, list) and next(tree_leaves(value), None) is None


def _flatten(data: Any, path: str = "") -> tuple[Any, list[tuple[str, Any]]]:
    """A comparable description of the structure, and its leaves with their paths."""
    if data is None:
        return "None", []
    if isinstance(data, Tensor) or _is_rows(data):
        return "leaf", [(path or "data", data)]
    if isinstance(data, (list, tuple, Mapping)):
        mapping, specs, leaves = isinstance(data, Mapping), [], []
        for key, value in data.items() if isinstance(data, Mapping) else enumerate(data):
            spec, sub = _flatten(value, f"{path}[{key!r}]")
            specs.append((repr(key), spec) if mapping else spec)
            leaves += sub
        return ("dict" if mapping else type(data).__name__, tuple(specs)), leaves
    raise TypeError(
        f"`data` should hold tensors, lists of row values or dicts/tuples/lists of those,"
        f" got {type(data).__name__} at {path or 'the top'}."
    )


def _unflatten(data: Any, leaves: Any) -> Any:
    """Rebuild the structure of ``data`` with leaves taken in order from the iterator ``leaves``."""
    return tree_map(lambda _: next(leaves), data, is_leaf=lambda value: isinstance(value, Tensor) or _is_rows(value))


class _LeafMeta(NamedTuple):
    """What a rank tells the others about one leaf of its ``data``."""

    kind: str  # "tensor", or "rows" for a list of Python objects
    dtype: str  # the tensor's dtype without "torch.", "list" for rows
    shape: tuple[int, ...]  # the tensor's shape, (len,) for rows

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


class _RankMeta(NamedTuple):
    """What one rank sends in :func:`_gather_with_metadata`'s single object gather."""

    spec: Any  # the structure of its data, from _flatten
    leaves: list[_LeafMeta]  # one per leaf, in _flatten's order
    rows: list[list[Any] | None]  # per leaf, its row list itself (they travel here, not in a tensor); None: a tensor
    error: str | None = None  # a failure found on that rank, raised by every rank


def _describe(leaf: Any) -> _LeafMeta:
    if isinstance(leaf, Tensor):
        return _LeafMeta("tensor", str(leaf.dtype).replace("torch.", ""), tuple(leaf.shape))
    return _LeafMeta("rows", "list", (len(leaf),))


def _pad(tensor: Tensor, shape: tuple, pad_value: float | None) -> Tensor:
    """``tensor`` placed at the start of a tensor of ``shape`` filled with ``pad_value``."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    out = torch.full(shape, 0 if pad_value is None else pad_value, dtype=tensor.dtype, device=tensor.device)
    if tensor.numel():
        out[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


def concat_batches(batches: list[Any], pad_value: float | None, step: str) -> Any:
    """Concatenate one rank's per-batch outputs along dim 0, leaf by leaf."""
    flat: list[tuple[Any, list[tuple[str, Any]]]] = []
    for i, out in enumerate(batches):
        flat.append(_flatten(out))
        if flat[-1][0] != flat[0][0]:
            raise ValueError(f"`{step}` returned a different structure in batch {i} than in batch 0.")
    merged: list[Any] = []
    for j, (name, _) in enumerate(flat[0][1]):
        parts = [leaves[j][1] for _, leaves in flat]
        if not isinstance(parts[0], Tensor):
            merged.append([item for part in parts for item in part])
            continue
        if any(part.dim() == 0 for part in parts):
            raise ValueError(
                f"`{step}` returned a 0-dim tensor at {name}; SequentialEvaluation needs one row per sample."
            )
        trailing = {tuple(part.shape[1:]) for part in parts}
        if len(trailing) > 1:
            if pad_value is None or len({part.dim() for part in parts}) > 1:
                raise ValueError(
                    f"`{step}` returned {name} with shapes {sorted(trailing)} across batches; pass `pad_value` to pad"
                    " variable-length outputs."
                )
            width = tuple(max(sizes) for sizes in zip(*trailing, strict=True))
            parts = [_pad(part, (part.shape[0], *width), pad_value) for part in parts]
        merged.append(torch.cat(parts))
    return _unflatten(batches[0], iter(merged))


def num_rows(data: Any, step: str) -> int:
    """The number of rows (dim 0) that every leaf of ``data`` has; ``step`` names the source in errors."""
    rows = {name: len(leaf) for name, leaf in _flatten(data)[1]}
    if len(set(rows.values())) > 1:
        raise ValueError(f"`{step}` returned leaves with different numbers of rows: {rows}.")
    return next(iter(rows.values()), 0)


def truncate_rows(data: Any, n: int) -> Any:
    """The first ``n`` rows of every leaf of ``data``."""
    return _unflatten(data, iter([leaf[:n] for _, leaf in _flatten(data)[1]]))


def _gather_with_metadata(
    spec: Any, leaves: list[tuple[str, Any]], error: str | None, pad_value: float | None, group: Any
) -> list[Any]:
    """One object gather of every rank's structure, shapes, error and row lists, then one gather per tensor."""
    mine = _RankMeta(
        spec, [_describe(leaf) for _, leaf in leaves], [leaf if _is_rows(leaf) else None for _, leaf in leaves], error
    )
    all_meta: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(all_meta, mine, group=group)
    if failed := [(rank, meta.error) for rank, meta in enumerate(all_meta) if meta.error is not None]:
        raise ValueError("; ".join(f"rank {rank}: {message}" for rank, message in failed))
    _check_consistent(all_meta, leaves, pad_value)
    outs: list[Any] = []
    for j, (_, leaf) in enumerate(leaves):
        if _is_rows(leaf):
            outs.append([item for meta in all_meta for item in meta.rows[j]])
        else:
            outs.append(_gather_tensor(leaf, [meta.leaves[j].shape for meta in all_meta], pad_value, group))
    return outs


# The tensor round: every distributed call opens with one all-gather of equal-size byte buffers, one per rank:
#     [ _Header (int64) ][ every leaf's shape (int64) ][ every leaf's bytes if _FITS, each at a multiple of _ALIGN ]
# Agreeing fingerprints (structure, dtypes, numbers of dims) differ at most in shapes, so each rank reads the others'
# shapes with its own numbers of dims. _FITS: the bytes follow; _SHAPES: they did not fit, one gather per tensor
# follows; _FULL (rows, an error, a sparse or quantized tensor) or disagreeing fingerprints: _gather_with_metadata.
# Buffer size: the previous call's largest ``needed`` rounded up to a power of two in [_MIN_BYTES, _MAX_BYTES],
# _MIN_BYTES if more was needed; every rank reads the same headers, so every rank picks the same size.
_FITS, _SHAPES, _FULL = 0, 1, 2
_ALIGN = 16  # every leaf starts at a multiple of this byte, so its bytes view as any dtype
_MIN_BYTES, _MAX_BYTES = 4096, 1 << 20


class _Header(NamedTuple):
    """The int64 words that open every rank's buffer, before its leaves' shapes."""

    status: int  # _FITS, _SHAPES or _FULL
    fingerprint: int = 0  # blake2b of the structure, dtypes and numbers of dims
    needed: int = 0  # the bytes of header, shapes and data, for the next call's buffer size


class _GroupBuffers(NamedTuple):
    """A process group's buffers, and views of its leaves in them, kept between calls."""

    send: Tensor
    recv: Tensor  # [rank, byte]: every rank's send buffer
    views: dict[tuple, tuple[list[Tensor], list[tuple[Tensor, ...]]]]  # by leaf_views' arguments

    def leaf_views(self, shapes: tuple, dtypes: tuple) -> tuple[list[Tensor], list[tuple[Tensor, ...]]]:
        """Each leaf's place in ``send``, and its places in ``recv`` when every rank sent these shapes and dtypes."""
        found = self.views.get((shapes, dtypes))
        if found is None:
            if len(self.views) >= 16:
                self.views.clear()
            bounds = _bounds(shapes, dtypes)
            found = self.views[(shapes, dtypes)] = (
                list(map(functools.partial(_view, self.send), bounds, dtypes, shapes)),
                [
                    tuple(_view(row, start, dtype, shape) for row in self.recv)
                    for start, dtype, shape in zip(bounds, dtypes, shapes, strict=False)
                ],
            )
        return found


_buffers: weakref.WeakKeyDictionary[Any, _GroupBuffers] = weakref.WeakKeyDictionary()  # per process group


def _gather_tensors(
    spec: Any, leaves: list[tuple[str, Any]], error: str | None, pad_value: float | None, group: Any, world: int
) -> list[Any] | None:
    """The tensor round above, then the data if it did not fit; ``None`` sends the caller to
    :func:`_gather_with_metadata`, whose errors name every rank's shapes."""
    tensors: list[Tensor] = [leaf for _, leaf in leaves]
    key, device = dist.group.WORLD if group is None else group, collective_device(group)
    buffers = _buffers.get(key)
    if buffers is None or buffers.send.device != device:
        buffers = _buffers[key] = _new_buffers(_MIN_BYTES, device, world)
    header, shapes = _pack(buffers, spec, tensors) if error is None else (_Header(_FULL), ())
    words = [*header, *itertools.chain.from_iterable(shapes)]
    if buffers.send.is_cpu:  # numpy writes a few words into a CPU tensor faster than torch does
        buffers.send.numpy().view(np.int64)[: len(words)] = words
    else:
        buffers.send[: 8 * len(words)].view(torch.int64).copy_(torch.tensor(words, dtype=torch.int64))
    _all_gather_single(buffers.recv.view(-1), buffers.send, group)
    read = buffers.recv[:, : 8 * len(words)].cpu().numpy().view(np.int64).tolist()
    headers = [_Header(*row[: len(header)]) for row in read]
    most = max(h.needed for h in headers)  # the same on every rank, and so is the next size
    size = _MIN_BYTES if most > _MAX_BYTES else max(_MIN_BYTES, 1 << (most - 1).bit_length())
    if size != buffers.send.numel():
        _buffers[key] = _new_buffers(size, device, world)
    if any(h.status == _FULL for h in headers) or len({h.fingerprint for h in headers}) > 1:
        return None
    dims, dtypes = [len(shape) for shape in shapes], tuple(t.dtype for t in tensors)
    if header.status == _FITS and all(dims) and read.count(read[0]) == world:  # every rank sent this rank's words
        parts = buffers.leaf_views(shapes, dtypes)[1]
        return [torch.cat(part).to(t.device) for t, part in zip(tensors, parts, strict=True)]
    starts = list(itertools.accumulate(dims, initial=len(header)))
    all_shapes = [[tuple(row[i : i + n]) for i, n in zip(starts, dims, strict=False)] for row in read]  # [rank][leaf]
    all_meta = [
        _RankMeta(spec, [_describe(t)._replace(shape=shape) for t, shape in zip(tensors, rank, strict=True)], [])
        for rank in all_shapes
    ]
    _check_consistent(all_meta, leaves, pad_value)  # the same errors as the full exchange
    if any(h.status == _SHAPES for h in headers):
        return [_gather_tensor(t, [rank[j] for rank in all_shapes], pad_value, group) for j, t in enumerate(tensors)]
    pieces = [  # [rank][leaf]
        list(map(functools.partial(_view, recv), _bounds(rank, dtypes), dtypes, rank))
        for recv, rank in zip(buffers.recv, all_shapes, strict=True)
    ]
    return [_cat_pieces(t, [rank[j] for rank in pieces], pad_value) for j, t in enumerate(tensors)]


def _pack(buffers: _GroupBuffers, spec: Any, tensors: list[Any]) -> tuple[_Header, tuple[torch.Size, ...]]:
    """This rank's header and shapes, and its bytes written into the send buffer when they fit."""
    if not all(isinstance(t, Tensor) and t.layout == torch.strided and not t.is_quantized for t in tensors):
        return _Header(_FULL), ()
    shapes, dtypes = tuple(t.shape for t in tensors), tuple(t.dtype for t in tensors)
    bounds, size = _bounds(shapes, dtypes), buffers.send.numel()
    status = _FITS if bounds[-1] <= size else _SHAPES if bounds[0] <= size else _FULL
    try:
        for t, view in zip(tensors, buffers.leaf_views(shapes, dtypes)[0] if status == _FITS else [], strict=False):
            view.copy_(t.detach())
    except (RuntimeError, TypeError, ValueError):  # bytes that cannot be copied as they are: the full exchange
        status = _FULL
    if status == _FULL:
        return _Header(_FULL), ()
    return _Header(status, _fingerprint(spec, tuple(zip(dtypes, map(len, shapes), strict=True))), bounds[-1]), shapes


def _bounds(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> list[int]:
    """Where each leaf's bytes start in a rank's buffer, after its header and shapes, then where they end."""
    bounds = [_aligned(8 * (len(_Header._fields) + sum(map(len, shapes))))]
    for shape, dtype in zip(shapes, dtypes, strict=True):
        bounds.append(_aligned(bounds[-1] + dtype.itemsize * math.prod(shape)))
    return bounds


def _view(buffer: Tensor, start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    return buffer[start : start + dtype.itemsize * math.prod(shape)].view(dtype).view(shape)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@functools.lru_cache(maxsize=64)
def _fingerprint(spec: Any, dtype_dims: tuple[tuple[torch.dtype, int], ...]) -> int:
    digest = hashlib.blake2b(repr((spec, dtype_dims)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _new_buffers(size: int, device: torch.device, world: int) -> _GroupBuffers:
    empty = functools.partial(torch.empty, dtype=torch.uint8, device=device)
    return _GroupBuffers(empty(size), empty(world, size), {})


def _all_gather_single(out: Tensor, local: Tensor, group: Any) -> None:
    # looked up at each call (count_collectives wraps it); the older name for an older torch (the GPU machine's)
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather_single(out, local, group=group)


def _cat_pieces(tensor: Tensor, pieces: list[Tensor], pad_value: float | None) -> Tensor:
    """Every rank's rows of one leaf, padded to the largest trailing shape, concatenated on ``tensor``'s device."""
    filled = [piece for piece in pieces if piece.shape[0] > 0] or pieces
    trailing = tuple(max(sizes) for sizes in zip(*(piece.shape[1:] for piece in filled), strict=True))
    return torch.cat([_pad(piece, (piece.shape[0], *trailing), pad_value) for piece in filled]).to(tensor.device)


def _check_consistent(all_meta: list[_RankMeta], leaves: list[tuple[str, Any]], pad_value: float | None) -> None:
    def table() -> str:
        return "; ".join(
            f"rank {rank}: " + ", ".join(f"{name} {leaf}" for (name, _), leaf in zip(leaves, meta.leaves, strict=False))
            for rank, meta in enumerate(all_meta)
        )

    if len({repr(meta.spec) for meta in all_meta}) > 1:
        shown = "; ".join(f"rank {rank}: {meta.spec}" for rank, meta in enumerate(all_meta))
        raise ValueError(f"`data` has a different structure on each rank, so it cannot be concatenated: {shown}.")
    for j, (name, _) in enumerate(leaves):
        ranks = [meta.leaves[j] for meta in all_meta]  # this leaf on every rank
        if len({(leaf.kind, leaf.dtype) for leaf in ranks}) > 1:
            raise ValueError(f"`data` {name} has a different dtype on each rank: {table()}.")
        shapes = [leaf.shape for leaf in ranks if leaf.kind == "tensor" and leaf.shape and leaf.shape[0] > 0]
        if len({len(shape) for shape in shapes}) > 1 or any(len(leaf.shape) == 0 for leaf in ranks):
            raise ValueError(f"`data` {name} needs the same number of dims (>= 1) on every rank: {table()}.")
        if len({shape[1:] for shape in shapes}) > 1 and pad_value is None:
            raise ValueError(
                f"`data` {name} has different trailing shapes on each rank (pass `pad_value` to pad them): {table()}."
            )


def _gather_tensor(tensor: Tensor, shapes: list[tuple], pad_value: float | None, group: Any) -> Tensor:
    """Pad to the largest shape, gather into one buffer (no ``torch.cat`` copy), trim each rank's rows."""
    filled = [shape for shape in shapes if shape[0] > 0] or shapes
    trailing = tuple(max(sizes) for sizes in zip(*(shape[1:] for shape in filled), strict=True))
    rows = [shape[0] for shape in shapes]
    if max(rows) == 0:
        return tensor.new_empty((0, *trailing))
    device = collective_device(group)
    local = _pad(tensor.to(device), (max(rows), *trailing), pad_value).contiguous()
    out = torch.empty((len(rows) * max(rows), *trailing), dtype=tensor.dtype, device=device)
    _all_gather_single(out, local, group)
    last = max(r for r, n in enumerate(rows) if n)
    if all(n == max(rows) for n in rows[:last]):  # only trailing ranks are short (the sampler's case): a view
        return out[: sum(rows)].to(tensor.device)
    return torch.cat([out[r * max(rows) : r * max(rows) + n] for r, n in enumerate(rows)]).to(tensor.device)
