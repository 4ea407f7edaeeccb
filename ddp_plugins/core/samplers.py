"""Samplers
========

:class:`SequentialDistributedSampler`: contiguous, equal-length shards for exact distributed
evaluation. ``DistributedSampler`` interleaves samples over ranks and pads the last shard with
samples from the *start* of the dataset, so metrics reduced over ranks count duplicates
(pytorch issue 25162); this one pads only at the end, so concatenating the shards in rank order
and truncating gives the dataset exactly, in order. It subclasses ``DistributedSampler`` so that
Lightning leaves it in place. Plain torch, no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from torch.utils.data import Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler
from typing_extensions import override

from ddp_plugins.core.checks import ArgumentTypeError

__all__ = ["SequentialDistributedSampler"]


class SequentialDistributedSampler(DistributedSampler):
    """Contiguous, equal-length shards: rank ``r`` gets ``dataset[r * n : (r + 1) * n]`` in order.

    ``n = ceil(len(dataset) / num_replicas)``. Shards past the end of the dataset are padded by
    repeating the last index, so every rank runs the same number of steps and collectives line
    up; concatenating the shards in rank order and keeping the first ``len(dataset)`` entries
    gives the dataset exactly, in order. ``num_real_samples`` says how many of this rank's
    samples are real (the rest are padding, at the end of the shard).

    Args:
        dataset: a map-style dataset (with ``__len__``).
        num_replicas: number of ranks; the world size of the default process group when ``None``.
        rank: this rank; the rank in the default process group when ``None``.

    Raises:
        TypeError: ``dataset`` is an ``IterableDataset`` or has no length.

    Example::

        >>> [list(SequentialDistributedSampler(range(5), num_replicas=2, rank=r)) for r in (0, 1)]
        [[0, 1, 2], [3, 4, 4]]
        >>> SequentialDistributedSampler(range(5), num_replicas=2, rank=1).num_real_samples
        2
    """

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ArgumentTypeError(
                "dataset",
                "a map-style dataset with a length",
                problem=f"got {type(dataset).__name__}",
                hint="An IterableDataset cannot be split into contiguous shards: shard it per rank yourself"
                " and gather the results with `distributed_concat`.",
            )
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.dataset_length = len(dataset)
        self.num_samples = math.ceil(self.dataset_length / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.num_real_samples = max(0, min(self.num_samples, self.dataset_length - self.rank * self.num_samples))

    @override
    def __iter__(self) -> Iterator[int]:
        start = self.rank * self.num_samples
        padding = [self.dataset_length - 1] * (self.num_samples - self.num_real_samples)
        return iter(list(range(start, start + self.num_real_samples)) + padding)

    @override
    def __len__(self) -> int:
        return self.num_samples
