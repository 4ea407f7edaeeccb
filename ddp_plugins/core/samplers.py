"""Contiguous shards for exact distributed evaluation, and a training sampler that resumes mid-epoch."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from typing_extensions import override

from ddp_plugins.core.checks import ArgumentTypeError
from ddp_plugins.core.seeding import isolated_rng, rank_seed

__all__ = ["PaddingApartSampler", "ResumableSampler", "SequentialDistributedSampler"]


class SequentialDistributedSampler(DistributedSampler):
    """Contiguous, equal-length shards: rank ``r`` gets ``dataset[r * n : (r + 1) * n]`` in order.

    ``n = ceil(len(dataset) / num_replicas)``; the last shard repeats its last index (``num_real_samples``: the real
    ones). ``DistributedSampler`` interleaves and pads from the start; this subclass of it is kept by Lightning.

    Args:
        dataset: a map-style dataset (with ``__len__``).
        align: each shard's length is a multiple of this (the batch size), so a batch's rows do not depend on the
            number of ranks; a rank past the end gets one padding sample.

    Example::

        >>> [list(SequentialDistributedSampler(range(5), num_replicas=2, rank=r)) for r in (0, 1)]
        [[0, 1, 2], [3, 4, 4]]
        >>> SequentialDistributedSampler(range(5), num_replicas=2, rank=1).num_real_samples
        2
        >>> [list(SequentialDistributedSampler(range(10), num_replicas=4, rank=r, align=4)) for r in range(4)]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [9]]
    """

    def __init__(
        self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None, align: int = 1
    ) -> None:
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
        shard = math.ceil(math.ceil(self.dataset_length / self.num_replicas) / align) * align
        self.total_size = shard * self.num_replicas
        self.start = self.rank * shard
        self.num_real_samples = max(0, min(shard, self.dataset_length - self.start))
        self.num_samples = shard if align == 1 else max(self.num_real_samples, 1)

    @override
    def __iter__(self) -> Iterator[int]:
        padding = [self.dataset_length - 1] * (self.num_samples - self.num_real_samples)
        return iter(list(range(self.start, self.start + self.num_real_samples)) + padding)


class PaddingApartSampler(SequentialDistributedSampler):
    """Contiguous shards of whole batches, where a padding row never shares a batch with a real one.

    The dataset's batches go to the ranks in order, ``B = ceil(batches / num_replicas)`` each; every rank runs ``B``
    and its padding fills whole batches, named by :meth:`is_padding` (docs/design.md, "Exact distributed evaluation").

    Example::

        >>> [list(PaddingApartSampler(range(7), num_replicas=4, rank=r, batch_size=2)) for r in range(4)]
        [[0, 1], [2, 3], [4, 5], [6]]
        >>> [list(PaddingApartSampler(range(9), num_replicas=4, rank=r, batch_size=2)) for r in range(4)]
        [[0, 1, 2, 3], [4, 5, 8, 8], [6, 7, 8], [8, 8, 8, 8]]
        >>> PaddingApartSampler(range(21), num_replicas=4, rank=1, batch_size=5).is_padding(1)
        True
    """

    def __init__(
        self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None, batch_size: int = 1
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank)
        self.batch_size = int(batch_size)
        batches = math.ceil(self.dataset_length / self.batch_size)
        per_rank = max(1, math.ceil(batches / self.num_replicas))
        last = max(0, math.ceil(batches / per_rank) - 1)  # the rank that holds the dataset's last batch
        counts = [per_rank] * last + [min(per_rank, batches)] + [0] * (self.num_replicas - last - 1)
        if last:
            counts[last - 1] = batches - per_rank * last  # between 1 and per_rank: the others keep per_rank
        first = sum(counts[: self.rank])
        self.start = first * self.batch_size
        self.num_real_samples = max(0, min(counts[self.rank] * self.batch_size, self.dataset_length - self.start))
        self.real_batches = counts[self.rank]
        self.num_samples = self.num_real_samples if self.rank == last else per_rank * self.batch_size
        self.total_size = per_rank * self.batch_size * self.num_replicas

    def is_padding(self, batch_index: int) -> bool:
        """Whether batch ``batch_index`` of this rank holds padding rows only (it counts for nothing)."""
        return batch_index >= self.real_batches


_LOADER_SEED_TAG = 0xD47A  # spawn-key tags: the loader streams never equal a rank's own stream
_ORDER_SEED_TAG, _RANK_ORDER_SEED_TAG = 0xD47B, 0xD47C


class ResumableSampler(Sampler):
    """A sampler that starts its first iteration ``skip`` indices in, at epoch ``epoch``.

    With ``seed`` it owns the DataLoader's :attr:`generator`, reseeded per ``(seed, rank, epoch)``, and the wrapped
    sampler draws its order in :func:`~ddp_plugins.core.seeding.isolated_rng` per ``(seed, epoch)`` (a
    ``DistributedSampler``) or ``(seed, rank, epoch)`` (docs/design.md, "Checkpoints and resume"). ``len()`` stays
    the full length: the training loop counts the skipped batches as done.

    Args:
        sampler: the sampler to wrap (``set_epoch`` is passed on when it has one).
        skip: indices to leave out of the first iteration only (batches done x batch size).
        seed: base seed of :attr:`generator` and of the wrapped sampler's order; ``None``: the global generators.

    Example::

        >>> sampler = ResumableSampler(range(10), skip=4)
        >>> list(sampler), list(sampler), len(sampler)
        ([4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 10)
    """

    def __init__(self, sampler: Any, skip: int = 0, epoch: int = 0, seed: int | None = None, rank: int = 0) -> None:
        self.sampler, self.skip, self.seed, self.rank = sampler, int(skip), seed, int(rank)
        self.generator, self.epoch = torch.Generator(), -1
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)
        if self.seed is not None and epoch != self.epoch:
            self.generator.manual_seed(loader_seed(self.seed, self.rank, epoch))
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        if self.seed is None:
            return itertools.islice(self.sampler, skip, None) if skip else iter(self.sampler)
        return self._isolated(self.seed, skip)

    def _isolated(self, seed: int, skip: int) -> Iterator[Any]:
        """The wrapped sampler's order, drawn whole at the first item on generators seeded for this epoch."""
        key = (_ORDER_SEED_TAG,) if isinstance(self.sampler, DistributedSampler) else (_RANK_ORDER_SEED_TAG, self.rank)
        with isolated_rng(rank_seed(seed, *key, self.epoch)):
            indices = list(self.sampler)
        yield from indices[skip:]

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:  # shuffle, num_replicas, ... of the wrapped sampler
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)


def loader_seed(seed: int, rank: int, epoch: int) -> int:
    """The seed of a rank's DataLoader generator in an epoch (distinct per rank and epoch).

    Example::

        >>> loader_seed(42, 0, 1) != loader_seed(42, 1, 1) != loader_seed(42, 0, 2)
        True
    """
    return rank_seed(seed, _LOADER_SEED_TAG, rank, epoch)
