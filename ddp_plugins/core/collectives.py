"""Collectives
===========

:func:`distributed_concat` gathers every rank's rows (tensors, nested containers of them, lists of
Python objects) in rank order, whatever each rank holds; the row helpers serve the adapter that
collects step outputs. Plain torch.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import struct
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ddp_plugins.core.checks import check_int, check_number
from ddp_plugins.core.ranks import collective_device, is_distributed

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

    ``data`` is a tensor, a list of Python objects (one entry per row: ids, strings, or per-row
    dicts and tuples without tensors, as Accelerate's ``gather_for_metrics`` takes them), or a
    nested dict / tuple / list of those (lists holding tensors are structure). Ranks
    may hold different numbers of rows, including none. Every rank gets the full result, with
    tensors on the device they came from. Works without a process group (world size 1).

    Tensors whose structure and dtypes agree on every rank take one collective round when they fit
    the buffer size the group's previous call agreed on (at most 1 MiB per rank; the shapes travel
    with the data), else a small round of shapes, then the data. Python rows, ranks that disagree and
    ``local_error`` add one exchange of every rank's full metadata, whose errors name every rank's
    shapes. The buffers are kept per process group between calls.

    Args:
        data: this rank's rows.
        num_total_examples: keep only the first this many rows of the result (drops the padding of
            :class:`SequentialDistributedSampler`); ``None`` keeps everything.
        pad_value: when given, tensors whose trailing dimensions differ across ranks (variable
            length sequences) are padded to the largest with this value; when ``None`` they raise.
        group: the process group; the default group when ``None``.
        local_error: a failure this rank found while preparing ``data`` (``data`` is then ignored):
            it travels with the shapes, so every rank raises it together instead of the others
            waiting in the gather.

    Raises:
        ValueError: structures, dtypes or trailing shapes differ across ranks (the message lists
            every rank's shapes and is raised on every rank), or an argument is invalid.
        TypeError: ``data`` holds something that is neither a tensor, a container nor a list of rows.

    Example::

        >>> distributed_concat({"preds": torch.arange(4), "ids": ["a", "b", "c", "d"]}, 3)
        {'preds': tensor([0, 1, 2]), 'ids': ['a', 'b', 'c']}
    """
    return _concat(data, num_total_examples, pad_value=pad_value, group=group, error=local_error)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(item) for item in value)
    return False


def _is_rows(value: Any) -> bool:
    """A list of Python objects, one per row: scalars, strings, or dicts/tuples without tensors."""
    return isinstance(value, list) and not _holds_tensor(value)


def _flatten(data: Any, path: str = "") -> tuple[Any, list[tuple[str, Any]]]:
    """A comparable description of the structure, and its leaves with their paths."""
    if data is None:
        return "None", []
    if isinstance(data, Tensor) or _is_rows(data):
        return "leaf", [(path or "data", data)]
    if isinstance(data, Mapping):
        specs, leaves = [], []
        for key, value in data.items():
            spec, sub = _flatten(value, f"{path}[{key!r}]")
            specs.append((repr(key), spec))
            leaves += sub
        return ("dict", tuple(specs)), leaves
    if isinstance(data, (list, tuple)):
        specs, leaves = [], []
        for i, value in enumerate(data):
            spec, sub = _flatten(value, f"{path}[{i}]")
            specs.append(spec)
            leaves += sub
        return (type(data).__name__, tuple(specs)), leaves
    raise TypeError(
        f"`data` should hold tensors, lists of row values or dicts/tuples/lists of those,"
        f" got {type(data).__name__} at {path or 'the top'}."
    )


def _unflatten(data: Any, leaves: Any) -> Any:
    """Rebuild the structure of ``data`` with leaves taken in order from the iterator ``leaves``."""
    if data is None:
        return None
    if isinstance(data, Tensor) or _is_rows(data):
        return next(leaves)
    if isinstance(data, Mapping):
        return {key: _unflatten(value, leaves) for key, value in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_unflatten(value, leaves) for value in data))
    return type(data)(_unflatten(value, leaves) for value in data)


class _LeafMeta(NamedTuple):
    """What a rank tells the others about one leaf of its ``data``."""

    kind: str  # "tensor", or "rows" for a list of Python objects
    dtype: str  # the tensor's dtype without "torch.", "list" for rows
    shape: tuple[int, ...]  # the tensor's shape, (len,) for rows

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


class _RankMeta(NamedTuple):
    """What one rank sends in :func:`_concat`'s single metadata gather."""

    spec: Any  # the structure of its data, from _flatten
    leaves: list[_LeafMeta]  # one per leaf, in _flatten's order
    rows: list[list[Any]]  # its row lists themselves, in leaf order (they travel here, not in a tensor)
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
    flat: list[tuple[Any, list[Any]]] = []
    for i, out in enumerate(batches):
        spec, leaves = _flatten(out)
        if flat and spec != flat[0][0]:
            raise ValueError(f"`{step}` returned a different structure in batch {i} than in batch 0.")
        flat.append((spec, [leaf for _, leaf in leaves]))
    names = [name for name, _ in _flatten(batches[0])[1]]
    merged: list[Any] = []
    for j, name in enumerate(names):
        parts = [leaves[j] for _, leaves in flat]
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


def _concat(
    data: Any,
    num_total_examples: int | None,
    *,
    pad_value: float | None = None,
    group: Any = None,
    error: str | None = None,
) -> Any:
    """:func:`distributed_concat`, plus ``error``: a failure found on this rank, raised on every rank."""
    if num_total_examples is not None:
        check_int("num_total_examples", num_total_examples, 0, allow_none=True)
    if pad_value is not None:
        check_number("pad_value", pad_value, allow_none=True)
    spec: Any = None
    leaves: list[tuple[str, Any]] = []
    if error is None:
        try:
            spec, leaves = _flatten(data)
        except TypeError as exc:
            error = str(exc)
    world = dist.get_world_size(group) if is_distributed() else 1
    if world == 1:
        if error is not None:
            raise ValueError(error)
        names = [name for name, _ in leaves]
        _check_consistent([_RankMeta(spec, [_describe(leaf) for _, leaf in leaves], [])], names, pad_value)
        outs = [list(leaf) if _is_rows(leaf) else leaf for _, leaf in leaves]
    else:
        # None for Python rows, a local error or ranks that disagree: then every rank's full metadata
        tensors_only = _gather_shapes_with_data(spec, leaves, error, pad_value, group, world)
        outs = (
            tensors_only if tensors_only is not None else _gather_with_metadata(spec, leaves, error, pad_value, group)
        )
    result = _unflatten(data, iter(outs))
    return result if num_total_examples is None else truncate_rows(result, num_total_examples)


def _gather_with_metadata(
    spec: Any, leaves: list[tuple[str, Any]], error: str | None, pad_value: float | None, group: Any
) -> list[Any]:
    """One object gather of every rank's structure, shapes, error and row lists, then one gather per tensor."""
    mine = _RankMeta(
        spec, [_describe(leaf) for _, leaf in leaves], [leaf for _, leaf in leaves if _is_rows(leaf)], error
    )
    all_meta: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(all_meta, mine, group=group)
    failed = [(rank, meta.error) for rank, meta in enumerate(all_meta) if meta.error is not None]
    if failed:
        raise ValueError("; ".join(f"rank {rank}: {message}" for rank, message in failed))
    _check_consistent(all_meta, [name for name, _ in leaves], pad_value)
    outs: list[Any] = []
    row_leaf = 0
    for j, (_, leaf) in enumerate(leaves):
        if _is_rows(leaf):
            outs.append([item for meta in all_meta for item in meta.rows[row_leaf]])
            row_leaf += 1
        else:
            outs.append(_gather_tensor(leaf, [meta.leaves[j].shape for meta in all_meta], pad_value, group))
    return outs


# The first round of every distributed call: each rank sends a buffer of the size its group agreed
# on: a header of _HEADER_WORDS int64 words, its leaves' shapes, then its leaves' bytes if they fit.
_HEADER_WORDS = 8  # status, fingerprint (2 words), leaves, shape words, bytes needed, 2 unused
_FITS, _SHAPES, _FULL = 0, 1, 2  # status: data inline; shapes only; full metadata exchange needed
_ALIGN = 16  # every leaf starts at a multiple of this byte, so its bytes view as any dtype
_FIRST_ROUND_BYTES = 4096  # the buffer size of a group's first call, and the smallest
_INLINE_MAX_BYTES = 1 << 20  # larger data goes in a second round, gathered in place without copies


class _Round:
    """One group's agreed first-round size, and its send and receive buffers (kept for the next call)."""

    def __init__(self, size: int, backend: str) -> None:
        self.size = size
        self.backend = backend  # the group's, read once
        self.device: torch.device | None = None
        self.send_bytes: bytearray | None = None  # CPU buffers are Python bytearrays: struct writes the header
        self.recv_bytes: bytearray | None = None
        self.send = self.recv = torch.empty(0, dtype=torch.uint8)
        self.cached: dict[tuple, tuple[list[Tensor], list[tuple[Tensor, ...]]]] = {}  # views per layout, by views()
        self.repeats: dict[tuple, _Repeat] = {}  # calls that took the common path on gloo, by signature

    def prepare(self, device: torch.device, world: int) -> None:
        if self.device == device and self.recv.numel() == world * self.size:
            return
        self.device = device
        self.cached.clear()
        self.repeats.clear()
        if device.type == "cpu":
            self.send_bytes, self.recv_bytes = bytearray(self.size), bytearray(world * self.size)
            self.send = torch.frombuffer(self.send_bytes, dtype=torch.uint8)
            self.recv = torch.frombuffer(self.recv_bytes, dtype=torch.uint8)
        else:
            self.send_bytes = self.recv_bytes = None
            self.send = torch.empty(self.size, dtype=torch.uint8, device=device)
            self.recv = torch.empty(world * self.size, dtype=torch.uint8, device=device)

    def views(self, dtype_shapes: tuple, offsets: list[int]) -> tuple[list[Tensor], list[tuple[Tensor, ...]]]:
        """Each leaf's place in the send buffer, and its place in every rank's part of the receive buffer."""
        found = self.cached.get(dtype_shapes)
        if found is None:
            if len(self.cached) > 16:
                self.cached.clear()
            recv = self.recv.view(-1, self.size)
            found = self.cached[dtype_shapes] = (
                [
                    self.send[offset : offset + dtype.itemsize * math.prod(shape)].view(dtype).view(shape)
                    for (dtype, shape), offset in zip(dtype_shapes, offsets, strict=True)
                ],
                [
                    recv[:, offset : offset + dtype.itemsize * math.prod(shape)]
                    .view(dtype)
                    .view(len(recv), *shape)
                    .unbind()
                    for (dtype, shape), offset in zip(dtype_shapes, offsets, strict=True)
                ],
            )
        return found

    def write(self, words: list[int]) -> None:
        if self.send_bytes is not None:
            struct.pack_into(f"={len(words)}q", self.send_bytes, 0, *words)
        else:
            self.send[: 8 * len(words)].copy_(torch.tensor(words, dtype=torch.int64).view(torch.uint8))

    def headers_are(self, header: bytes) -> bool:
        """Whether every rank's part of the CPU receive buffer starts with ``header``."""
        assert self.recv_bytes is not None
        received, n = memoryview(self.recv_bytes), len(header)
        return all(received[start : start + n] == header for start in range(0, len(received), self.size))

    def read(self, count: int) -> list[tuple[int, ...]]:
        """The first ``count`` words of every rank's buffer."""
        if self.recv_bytes is not None:
            words = _words(count)
            return [words.unpack_from(self.recv_bytes, start) for start in range(0, len(self.recv_bytes), self.size)]
        return [tuple(row) for row in self.recv.view(-1, self.size)[:, : 8 * count].view(torch.int64).tolist()]


@functools.lru_cache(maxsize=64)
def _words(count: int) -> struct.Struct:
    return struct.Struct(f"={count}q")


_rounds: weakref.WeakKeyDictionary[Any, _Round] = weakref.WeakKeyDictionary()  # per process group


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class _Layout(NamedTuple):
    """Where one rank's leaves sit in its first-round buffer."""

    words: list[int]  # the header after its status word, then every leaf's shape
    offsets: list[int]  # the byte where each leaf starts
    needed: int  # the bytes of header, shapes and leaves


class _Repeat(NamedTuple):
    """A call that took the common path on gloo: a later call with the same signature skips the
    planning and, when every rank sent the same header again, the reading of the headers."""

    signature: tuple  # (spec, ((dtype, shape, layout), ...))
    words: list[int]  # the header it wrote (still in the send buffer)
    layout: _Layout
    header: bytes  # those words as bytes, to compare with every rank's
    sends: list[Tensor]  # each leaf's place in the send buffer
    parts: list[tuple[Tensor, ...]]  # each leaf's place in every rank's part of the receive buffer


def _signature(spec: Any, tensors: list[Any]) -> tuple | None:
    try:
        return spec, tuple((t.dtype, t.shape, t.layout) for t in tensors)
    except AttributeError:  # Python rows
        return None


@functools.lru_cache(maxsize=64)
def _layout(spec: Any, dtype_shapes: tuple[tuple[torch.dtype, torch.Size], ...]) -> _Layout:
    """The layout of leaves of these dtypes and shapes; its fingerprint agrees across ranks when the
    structure, dtypes and numbers of dims all agree."""
    text = repr((spec, [(dtype, len(shape)) for dtype, shape in dtype_shapes])).encode()
    digest = hashlib.blake2b(text, digest_size=16).digest()
    shapes = [n for _, shape in dtype_shapes for n in shape]
    offsets, needed = [], _aligned(8 * (_HEADER_WORDS + len(shapes)))
    for dtype, shape in dtype_shapes:
        offsets.append(needed)
        needed = _aligned(needed + dtype.itemsize * math.prod(shape))
    fingerprint = [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in (0, 8)]
    return _Layout([*fingerprint, len(dtype_shapes), len(shapes), needed, 0, 0, *shapes], offsets, needed)


def _gather_shapes_with_data(
    spec: Any, leaves: list[tuple[str, Any]], error: str | None, pad_value: float | None, group: Any, world: int
) -> list[Any] | None:
    """Gather tensor-only data whose structure and dtypes agree on every rank, ``None`` when it does not.

    One collective when every rank's data fits the buffer size its group agreed on in the previous
    call (the shapes travel with the data); otherwise that round carries the shapes and the data
    follows in one in-place gather per tensor. Every rank reads the same headers, so every rank
    takes the same path and agrees on the buffer size of the next call. ``None`` (after that one
    round) sends the caller to :func:`_gather_with_metadata`, whose errors name every rank's shapes.
    """
    tensors: list[Tensor] = [leaf for _, leaf in leaves]
    key = dist.group.WORLD if group is None else group
    rnd = _rounds.get(key)
    if rnd is None:
        rnd = _rounds[key] = _Round(_FIRST_ROUND_BYTES, dist.get_backend(group))
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    signature = _signature(spec, tensors) if rnd.repeats and error is None else None
    repeat = rnd.repeats.get(signature) if signature is not None else None
    if repeat is not None and rnd.send_bytes is not None:
        try:
            for t, view in zip(tensors, repeat.sends, strict=True):
                view.copy_(t.detach() if t.requires_grad else t)
        except (RuntimeError, TypeError, ValueError):  # bytes that cannot be copied as they are: plan afresh
            repeat = None
    if repeat is not None and rnd.send_bytes is not None:
        # an earlier call's plan and header, in buffers that stay on the CPU (gloo only)
        rnd.send_bytes[: len(repeat.header)] = repeat.header
        all_gather_single(rnd.recv, rnd.send, group=group)
        if rnd.headers_are(repeat.header):
            return [
                torch.cat(parts) if t.is_cpu else torch.cat(parts).to(t.device)
                for t, parts in zip(tensors, repeat.parts, strict=True)
            ]
        words, layout, dtype_shapes = repeat.words, repeat.layout, tuple((t.dtype, t.shape) for t in tensors)
    else:
        rnd.prepare(collective_device(group), world)
        words = [_FULL, 0, 0, len(tensors), 0, 0, 0, 0]
        layout = None
        if error is None and all(
            isinstance(t, Tensor) and t.layout == torch.strided and not t.is_quantized for t in tensors
        ):
            dtype_shapes = tuple((t.dtype, t.shape) for t in tensors)
            layout = _layout(spec, dtype_shapes)
            needed, shapes_only = layout.needed, 8 * len(layout.words) + 8
            status = _FITS if needed <= rnd.size else _SHAPES if shapes_only <= rnd.size else _FULL
            try:
                if status == _FITS:
                    for t, view in zip(tensors, rnd.views(dtype_shapes, layout.offsets)[0], strict=True):
                        view.copy_(t.detach() if t.requires_grad else t)
            except (RuntimeError, TypeError, ValueError):  # bytes that cannot be copied as they are: the full exchange
                status = _FULL
            if status != _FULL:
                words = [status, *layout.words]
        rnd.write(words)
        all_gather_single(rnd.recv, rnd.send, group=group)
    read = rnd.read(len(words))
    agreed = all(row[0] != _FULL for row in read) and len({row[1:5] for row in read}) == 1
    most = max(row[5] for row in read)
    if not agreed or most > _INLINE_MAX_BYTES:
        size = _FIRST_ROUND_BYTES
    elif most > rnd.size or 4 * most < rnd.size:  # grow to fit, or shrink after a much smaller call
        size = max(most, _FIRST_ROUND_BYTES)
    else:
        size = rnd.size
    if size != rnd.size:
        _rounds[key] = _Round(size, rnd.backend)  # every rank read the same headers, so every rank agrees on it
    if layout is not None and words[0] == _FITS and read.count(read[0]) == world and all(t.dim() for t in tensors):
        # the common case: every rank sent the same header (structure, dtypes, shapes) and its data
        # fits, so each leaf is one concatenation of views
        sends, parts = rnd.views(dtype_shapes, layout.offsets)
        cached = rnd.backend == "gloo" and _rounds.get(key) is rnd and all(t.numel() for t in tensors)
        if cached and rnd.send_bytes is not None:
            if len(rnd.repeats) >= 8:
                rnd.repeats.clear()
            header = bytes(rnd.send_bytes[: 8 * len(words)])
            signature = signature or _signature(spec, tensors)
            if signature is not None:
                rnd.repeats[signature] = _Repeat(signature, words, layout, header, sends, parts)
        return [
            _on(torch.cat(part), t.device) if t.numel() else t.new_empty((world * t.shape[0], *t.shape[1:]))
            for t, part in zip(tensors, parts, strict=True)
        ]
    if not agreed or layout is None:
        return None
    dims = [t.dim() for t in tensors]
    all_shapes = [  # [rank][leaf]
        [
            tuple(row[start : start + dim])
            for start, dim in zip(itertools.accumulate(dims, initial=_HEADER_WORDS), dims, strict=False)
        ]
        for row in read
    ]
    dtypes = [str(t.dtype).replace("torch.", "") for t in tensors]
    all_meta = [
        _RankMeta(spec, [_LeafMeta("tensor", dtype, shape) for dtype, shape in zip(dtypes, shapes, strict=True)], [])
        for shapes in all_shapes
    ]
    _check_consistent(all_meta, [name for name, _ in leaves], pad_value)  # the same errors as the full exchange
    if any(row[0] != _FITS for row in read):
        return [
            _gather_tensor(t, [shapes[j] for shapes in all_shapes], pad_value, group) for j, t in enumerate(tensors)
        ]
    recv = rnd.recv.view(world, rnd.size)
    outs = []
    starts = [_aligned(8 * len(words))] * world
    for j, t in enumerate(tensors):
        pieces = []
        for rank in range(world):
            nbytes = t.element_size() * math.prod(all_shapes[rank][j])
            pieces.append(recv[rank, starts[rank] : starts[rank] + nbytes].view(t.dtype).view(all_shapes[rank][j]))
            starts[rank] = _aligned(starts[rank] + nbytes)
        outs.append(_cat_pieces(t, pieces, pad_value))
    return outs


def _on(tensor: Tensor, device: torch.device) -> Tensor:
    return tensor if tensor.device == device else tensor.to(device)


def _cat_pieces(tensor: Tensor, pieces: list[Tensor], pad_value: float | None) -> Tensor:
    """Every rank's rows of one leaf, padded to the largest trailing shape, concatenated on ``tensor``'s device."""
    filled = [piece for piece in pieces if piece.shape[0] > 0]
    trailing = tuple(max(sizes) for sizes in zip(*(piece.shape[1:] for piece in filled or pieces), strict=True))
    if not filled:
        return tensor.new_empty((0, *trailing))
    return torch.cat([_pad(piece, (piece.shape[0], *trailing), pad_value) for piece in filled]).to(tensor.device)


def _check_consistent(all_meta: list[_RankMeta], names: list[str], pad_value: float | None) -> None:
    def table() -> str:
        return "; ".join(
            f"rank {rank}: " + ", ".join(f"{name} {leaf}" for name, leaf in zip(names, meta.leaves, strict=False))
            for rank, meta in enumerate(all_meta)
        )

    if len({repr(meta.spec) for meta in all_meta}) > 1:
        shown = "; ".join(f"rank {rank}: {meta.spec}" for rank, meta in enumerate(all_meta))
        raise ValueError(f"`data` has a different structure on each rank, so it cannot be concatenated: {shown}.")
    for j, name in enumerate(names):
        leaves = [meta.leaves[j] for meta in all_meta]
        if len({(leaf.kind, leaf.dtype) for leaf in leaves}) > 1:
            raise ValueError(f"`data` {name} has a different dtype on each rank: {table()}.")
        shapes = [leaf.shape for leaf in leaves if leaf.kind == "tensor" and leaf.shape and leaf.shape[0] > 0]
        if len({len(shape) for shape in shapes}) > 1 or any(len(leaf.shape) == 0 for leaf in leaves):
            raise ValueError(f"`data` {name} needs the same number of dims (>= 1) on every rank: {table()}.")
        if len({shape[1:] for shape in shapes}) > 1 and pad_value is None:
            raise ValueError(
                f"`data` {name} has different trailing shapes on each rank (pass `pad_value` to pad them): {table()}."
            )


def _gather_tensor(tensor: Tensor, shapes: list[tuple], pad_value: float | None, group: Any) -> Tensor:
    """Pad to the largest shape, gather into one buffer, trim each rank's rows, concatenate.

    Gathering into one preallocated buffer (``all_gather_single``) instead of a list of tensors
    saves the ``torch.cat`` copy of the anchor; when only trailing ranks hold fewer rows the
    result is a view of that buffer.
    """
    filled = [shape for shape in shapes if shape[0] > 0] or shapes
    trailing = tuple(max(sizes) for sizes in zip(*(shape[1:] for shape in filled), strict=True))
    rows = [shape[0] for shape in shapes]
    if max(rows) == 0:
        return tensor.new_empty((0, *trailing))
    device = collective_device(group)
    local = _pad(tensor.to(device), (max(rows), *trailing), pad_value).contiguous()
    out = torch.empty((len(rows) * max(rows), *trailing), dtype=tensor.dtype, device=device)
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather_single(out, local, group=group)
    last = max(r for r, n in enumerate(rows) if n)
    if all(n == max(rows) for n in rows[:last]):  # only trailing ranks are short (the sampler's case): a view
        return out[: sum(rows)].to(tensor.device)
    return torch.cat([out[r * max(rows) : r * max(rows) + n] for r, n in enumerate(rows)]).to(tensor.device)
