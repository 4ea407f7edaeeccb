"""Count ``torch.distributed`` collectives in a test: patched for the block (the package patches nothing)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

# Collectives whose first argument is the output: what they send is their second.
_OUTPUT_FIRST = {"all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all", "all_to_all_single"}
_OUTPUT_FIRST |= {"reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"}


@dataclass
class CollectiveCounts:
    """Calls and bytes sent (the positional input tensor or tensors) per collective name."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)


@contextlib.contextmanager
def count_collectives(
    names: Iterable[str] = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter"),
) -> Iterator[CollectiveCounts]:
    """Count the calls of ``torch.distributed.<name>`` (in every thread) while the body runs; counters nest.

    Calls on a ``ProcessGroup`` object, or through a reference taken earlier, are not seen.
    """
    counts = CollectiveCounts()
    with contextlib.ExitStack() as patches:
        for name in names:
            patches.enter_context(mock.patch.object(dist, name, _counting(name, getattr(dist, name), counts)))
        yield counts


def _counting(name: str, original: Callable[..., Any], counts: CollectiveCounts) -> Callable[..., Any]:
    def counting(*args: Any, **kwargs: Any) -> Any:
        sent = args[name in _OUTPUT_FIRST] if len(args) > (name in _OUTPUT_FIRST) else None
        counts.calls[name] += 1
        for tensor in sent if isinstance(sent, (list, tuple)) else [sent]:
            if isinstance(tensor, torch.Tensor):
                counts.bytes[name] += tensor.numel() * tensor.element_size()
        return original(*args, **kwargs)

    return counting
