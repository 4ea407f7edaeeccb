"""The pack's one walker over nested batches and results (dicts, namedtuples, tuples, lists), by hand:
torch's pytree is private and Lightning's ``apply_to_collection`` is not in the core's reach."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import Tensor

__all__ = ["tree_leaves", "tree_map"]


def _is_tensor(value: Any) -> bool:
    return isinstance(value, Tensor)


def tree_map(fn: Callable[[Any], Any], data: Any, is_leaf: Callable[[Any], bool] = _is_tensor) -> Any:
    """``data`` with every leaf replaced by ``fn(leaf)``; containers keep their type, other values stay.

    Example::

        >>> import torch
        >>> tree_map(lambda t: t[:0], {"x": torch.ones(3, 2), "ids": [torch.arange(3)], "name": "a"})
        {'x': tensor([], size=(0, 2)), 'ids': [tensor([], dtype=torch.int64)], 'name': 'a'}
    """
    if is_leaf(data):
        return fn(data)
    if isinstance(data, Mapping):
        mapped = {key: tree_map(fn, value, is_leaf) for key, value in data.items()}
        try:  # the mapping's own type where it is built from a dict (OrderedDict, a dict subclass)
            return mapped if type(data) is dict else type(data)(mapped)  # type: ignore[call-arg]
        except TypeError:  # a defaultdict, or a mapping built otherwise
            return mapped
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
        return type(data)(*(tree_map(fn, value, is_leaf) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(tree_map(fn, value, is_leaf) for value in data)
    return data


def tree_leaves(data: Any, is_leaf: Callable[[Any], bool] = _is_tensor) -> Iterator[Any]:
    """The leaves of ``data`` in order (dict values in their order, sequences front to back).

    Example::

        >>> import torch
        >>> [t.shape[0] for t in tree_leaves((torch.ones(4), {"y": torch.zeros(2)}, 7))]
        [4, 2]
    """
    if is_leaf(data):
        yield data
    elif isinstance(data, (Mapping, list, tuple)):
        for value in data.values() if isinstance(data, Mapping) else data:
            yield from tree_leaves(value, is_leaf)
