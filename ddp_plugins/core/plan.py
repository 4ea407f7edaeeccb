"""One global plan per epoch (rows' order, steps of ``G`` rows) whatever the world size; uneven shards.

By hand: ``DistributedSampler`` pads, and its order depends on the world size. See docs/design.md, "One global plan
per epoch, and uneven data".
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ddp_plugins.core.checks import ArgumentValueError, check_bool, check_int
from ddp_plugins.core.ranks import collective_device
from ddp_plugins.core.trees import tree_leaves, tree_map

__all__ = [
    "EmptyShareCollate",
    "EvenSteps",
    "GlobalPlan",
    "PlanBatchSampler",
    "PlanOrder",
    "even_split",
    "first_tensor_rows",
]


def even_split(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` counts that differ by at most one, the larger ones first.

    Example::

        >>> even_split(7, 3), even_split(2, 4)
        ([3, 2, 2], [1, 1, 0, 0])
    """
    q, extra = divmod(n, parts)
    return [q + 1] * extra + [q] * (parts - extra)


def _bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    return list(itertools.pairwise(itertools.accumulate(counts, initial=0)))


@dataclass(frozen=True)
class GlobalPlan:
    """The rows of every epoch in order, and their split into steps of ``global_batch_size`` rows.

    Args:
        global_batch_size: rows per optimizer step over all ranks and micro-batches (``G``).
        seed: epoch ``e``'s order is ``torch.randperm`` seeded with ``seed + e`` (``DistributedSampler``'s convention).
        shuffle: ``False`` keeps the dataset's order.
        drop_last: leave out the short last step of an epoch (off: it is trained as it is).
        virtual_shards: the reproducible mode's ``V`` shards per step, whole shards per rank (``even_split(V, N)``);
            ``None``: rows are split over the ranks directly.

    Raises:
        TypeError, ValueError: a count not an integer >= 1 (``seed`` >= 0), or a step with fewer rows than ``V``.

    Example::

        >>> plan = GlobalPlan(dataset_length=10, global_batch_size=4, shuffle=False)
        >>> plan.steps_per_epoch, plan.step_indices(0, 2), plan.counts(2, world_size=3)
        (3, [8, 9], [[1], [1], [0]])
        >>> [list(PlanBatchSampler(plan, rank=r, world_size=3)) for r in range(3)]
        [[[0, 1], [4, 5], [8]], [[2], [6], [9]], [[3], [7], []]]
    """

    dataset_length: int
    global_batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    virtual_shards: int | None = None

    def __post_init__(self) -> None:
        check_int("dataset_length", self.dataset_length, 1)
        check_int("global_batch_size", self.global_batch_size, 1)
        check_int("seed", self.seed, 0)
        check_bool("shuffle", self.shuffle)
        check_bool("drop_last", self.drop_last)
        if self.drop_last and self.global_batch_size > self.dataset_length:
            raise ArgumentValueError(
                "global_batch_size",
                f"at most the dataset's {self.dataset_length} rows with drop_last=True",
                self.global_batch_size,
            )
        if self.virtual_shards is not None:
            check_int("virtual_shards", self.virtual_shards, 1)
            last, shards = self.step_size(self.steps_per_epoch - 1), self.virtual_shards
            if min(self.global_batch_size, last) < shards:
                whole = self.global_batch_size < shards  # every step is too small, not only the last
                raise ArgumentValueError(
                    "global_batch_size",
                    f"one that leaves every step at least virtual_shards={shards} rows",
                    self.global_batch_size,
                    problem=f"got {self.global_batch_size}, fewer rows than shards in every step" if whole else (
                        f"got {self.global_batch_size}: {self.dataset_length} rows leave a last step of {last} rows"
                    ),
                    hint=f"Use virtual_shards<={self.global_batch_size} or global_batch_size>={shards}." if whole
                    else "Use drop_last=True or another global_batch_size.",
                )  # fmt: skip

    @property
    def steps_per_epoch(self) -> int:
        rounding = math.floor if self.drop_last else math.ceil
        return int(rounding(self.dataset_length / self.global_batch_size))

    def order(self, epoch: int) -> list[int]:
        """Every row of epoch ``epoch``, in the order it is trained (the same for any world size)."""
        if not self.shuffle:
            return list(range(self.dataset_length))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_length, generator=generator).tolist()

    def step_indices(self, epoch: int, step: int, order: Sequence[int] | None = None) -> list[int]:
        """The row indices of optimizer step ``step`` of ``epoch`` (the last one may be short)."""
        order = self.order(epoch) if order is None else order
        return list(order[step * self.global_batch_size : (step + 1) * self.global_batch_size])

    def step_size(self, step: int) -> int:
        """How many rows step ``step`` has (``global_batch_size`` except a short last step)."""
        return max(0, min(self.global_batch_size, self.dataset_length - step * self.global_batch_size))

    def counts(self, step: int, world_size: int, accumulate: int = 1) -> list[list[int]]:
        """``counts[r][m]``: the rows rank ``r`` trains in micro-batch ``m`` of step ``step``."""
        if self.virtual_shards is not None:  # whole shards per rank, one micro-batch
            check_int("accumulate", accumulate, 1, 1)
            sizes = self.shard_sizes(step)
            return [[sum(sizes[a:b])] for a, b in self.rank_shards(world_size)]
        shares, first = [], 0  # first: the rank that gets the next extra row
        for micro in even_split(self.step_size(step), accumulate):
            q, extra = divmod(micro, world_size)
            # the extra rows go round the ranks, so the step's shares stay as even as possible too
            shares.append([q + ((r - first) % world_size < extra) for r in range(world_size)])
            first = (first + extra) % world_size
        return [[share[rank] for share in shares] for rank in range(world_size)]

    def shard_sizes(self, step: int) -> list[int]:
        """The rows of each virtual shard of step ``step``, in order (the same on any world size)."""
        assert self.virtual_shards is not None
        return even_split(self.step_size(step), self.virtual_shards)

    def rank_shards(self, world_size: int) -> list[tuple[int, int]]:
        """``[first, stop)`` of the virtual shards each rank trains, a contiguous run per rank.

        Example::

            >>> GlobalPlan(20, 8, virtual_shards=4).rank_shards(3)
            [(0, 2), (2, 3), (3, 4)]
        """
        assert self.virtual_shards is not None
        if world_size > self.virtual_shards:
            raise ArgumentValueError(
                "world size",
                f"at most virtual_shards={self.virtual_shards} in the reproducible mode",
                world_size,
                hint="Raise virtual_shards (the same value for every run to be compared) or use fewer ranks.",
            )
        return _bounds(even_split(self.virtual_shards, world_size))

    def micro_batches(self, epoch: int, step: int, rank: int, world_size: int, accumulate: int = 1, order=None):
        """The ``accumulate`` micro-batches (lists of rows, maybe empty) of ``rank`` in a step."""
        rows = self.step_indices(epoch, step, order)
        counts = self.counts(step, world_size, accumulate)
        bounds = _bounds([c[m] for m in range(accumulate) for c in counts])  # micro-batch by micro-batch, rank by rank
        return [rows[a:b] for a, b in bounds[rank::world_size]]

    def loss_weight(self, step: int, micro: int, rank: int, world_size: int, accumulate: int = 1) -> float:
        """The factor ``N * accumulate * rows / step_rows`` on a rank's mean loss (divided by ``accumulate``) that
        makes DDP's average the mean over the step's rows (0 for an empty micro-batch)."""
        return world_size * accumulate * self.counts(step, world_size, accumulate)[rank][micro] / self.step_size(step)

    def state(self) -> dict[str, Any]:
        """What a checkpoint stores to check a resume against (plain Python values)."""
        return asdict(self)


class PlanOrder(Sampler):
    """The current epoch's rows in plan order: a :class:`PlanBatchSampler`'s ``sampler`` (Lightning sets its epoch)."""

    def __init__(self, plan: GlobalPlan, epoch: int = 0) -> None:
        self.plan, self.epoch = plan, epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(self.plan.order(self.epoch))

    def __len__(self) -> int:
        return self.plan.dataset_length


class PlanBatchSampler(Sampler):
    """Rank ``rank``'s micro-batches of every step of a :class:`GlobalPlan`, as a batch sampler.

    ``steps_per_epoch * accumulate`` lists of rows (maybe empty) per epoch on every rank; ``start_step`` skips the
    first steps of the first iteration only (a resumed epoch), drawing no random number.

    Args:
        rank, world_size: this rank and the number of ranks (any: the plan does not depend on it).
        accumulate: micro-batches per optimizer step (Lightning's ``accumulate_grad_batches``).
        epoch: the epoch of the first iteration.

    Example::

        >>> plan = GlobalPlan(dataset_length=5, global_batch_size=4, shuffle=False)
        >>> list(PlanBatchSampler(plan, rank=0, world_size=2, accumulate=2))
        [[0], [2], [4], []]
    """

    def __init__(
        self, plan: GlobalPlan, rank: int, world_size: int, accumulate: int = 1, epoch: int = 0, start_step: int = 0
    ) -> None:
        check_int("world_size", world_size, 1)
        check_int("rank", rank, 0, world_size - 1)
        check_int("accumulate", accumulate, 1)
        check_int("start_step", start_step, 0, plan.steps_per_epoch)
        self.plan, self.rank, self.world_size, self.accumulate = plan, rank, world_size, accumulate
        self.sampler = PlanOrder(plan, epoch)
        self.start_step = start_step

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        start, self.start_step = self.start_step, 0
        epoch = self.epoch
        order = self.plan.order(epoch)
        for step in range(start, self.plan.steps_per_epoch):
            yield from self.plan.micro_batches(epoch, step, self.rank, self.world_size, self.accumulate, order)

    def __len__(self) -> int:
        return self.plan.steps_per_epoch * self.accumulate


class EmptyShareCollate:
    """A ``collate_fn`` that turns an empty list of samples into a batch with zero rows.

    That is ``collate_fn([template])``, each tensor cut to ``[:0]`` (other leaves as collated). Picklable, for workers.

    Example::

        >>> collate = EmptyShareCollate(torch.utils.data.default_collate, (torch.ones(3), 1))
        >>> [tuple(t.shape) for t in collate([])]
        [(0, 3), (0,)]
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], template: Any) -> None:
        self.collate_fn, self.template = collate_fn, template

    def __call__(self, samples: list[Any]) -> Any:
        if samples:
            return self.collate_fn(samples)
        return _no_rows(self.collate_fn([self.template]))


_no_rows = functools.partial(tree_map, lambda tensor: tensor[:0])  # a batch's structure, every tensor cut to no rows
_FLAGS = 65  # flag values 0..64 (signal numbers)


def first_tensor_rows(batch: Any) -> int:
    """Rows of the batch's first tensor (1 for a scalar), -1 without one.

    Example::

        >>> first_tensor_rows({"x": torch.zeros(3, 2), "y": torch.zeros(3)}), first_tensor_rows(["no tensor"])
        (3, -1)
    """
    return next((len(t) if t.dim() else 1 for t in tree_leaves(batch)), -1)


class EvenSteps:
    """A rank's batches, in step with every other rank's whatever their counts (uneven shards).

    One ``all_reduce`` per optimizer step shares every rank's rows; all ranks end at the same step, an exhausted shard
    yielding zero-row batches. :attr:`batch_counts` gets ``(rows here, rows in the micro-batch, in the step, largest
    flag)`` per batch yielded. By hand: torch's ``Join`` counts ranks, not rows, and misses SyncBN's collectives.

    Args:
        batches: this rank's batches (a DataLoader of its shard).
        rows_of: the rows of a batch (the first tensor's length by default).
        device: where the counts are reduced; ``None``: :func:`~ddp_plugins.core.ranks.collective_device`.
        length: the agreed number of batches (the longest rank's), or ``None`` when unsized.
        flag: this rank's flag (0 to 64) at each step, agreed across ranks with the counts.
        window: micro-batches per optimizer step, counted in one round; or a callable read as each epoch starts.
        start: batches of the epoch already trained (a mid-epoch resume, same world size): each rank skips as many.

    Example (one process; the counts are reduced over the default group when one is set up)::

        >>> steps = EvenSteps([[1, 2]], length=1)
        >>> len(steps), steps.batch_counts
        (1, deque([]))
    """

    def __init__(
        self,
        batches: Iterable[Any],
        rows_of: Callable[[Any], int] | None = None,
        group: Any = None,
        device: torch.device | str | None = None,
        length: int | None = None,
        flag: Callable[[], int] | None = None,
        window: int | Callable[[], int] = 1,
        start: int = 0,
    ) -> None:
        self.batches, self.flag, self.group, self.length = batches, flag, group, length
        self.rows_of = rows_of or first_tensor_rows
        self.device = None if device is None else torch.device(device)
        self.window = window if callable(window) else check_int("window", window, 1)
        self.start = check_int("start", start, 0)
        self.batch_counts: deque[tuple[int, int, int, int]] = deque()
        self._template: Any = None

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("the ranks' shards have no agreed length")
        return self.length  # the epoch's, also while a resume skips its start (as Lightning counts)

    def __getattr__(self, name: str) -> Any:  # sampler, num_workers, ... of the wrapped loader
        if name == "batches":
            raise AttributeError(name)
        return getattr(self.batches, name)

    def __iter__(self) -> Iterator[Any]:
        self.batch_counts.clear()
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        k = check_int("window", self.window() if callable(self.window) else self.window, 1)
        batches = self._keeping_template()
        skip, self.start = self.start, 0  # a resume skips once, in its first epoch
        deque(itertools.islice(batches, skip), maxlen=0)
        while True:
            window = list(itertools.islice(batches, k))
            mine = [self.rows_of(batch) for batch in window] + [0] * (k - len(window))
            # rows per micro-batch | ranks without a template | ranks with one | batches here | flag (one-hots)
            sizes = [k, 1, world, k + 1, _FLAGS]
            counts = torch.zeros(sum(sizes), dtype=torch.int64)
            rows, missing, holders, here, flags = counts.split(sizes)  # views: filled in place
            rows[:] = torch.tensor(mine)
            missing[0] = int(self._template is None)
            holders[rank] = int(self._template is not None)
            here[len(window)] = 1  # one-hot: the sum keeps the longest rank's count
            flags[self.flag() if self.flag is not None else 0] = 1
            counts = counts.to(self.device or collective_device(self.group))
            dist.all_reduce(counts, group=self.group)
            rows, missing, holders, here, flags = counts.cpu().split(sizes)
            micro_rows = rows.tolist()
            present, agreed = int(here.nonzero()[-1]), int(flags.nonzero()[-1])
            if present == 0:
                return
            if int(missing):  # a rank that never had a batch: the lowest rank with one sends it
                source = int(holders.nonzero()[0])
                box = [self._template if rank == source else None]
                dist.broadcast_object_list(box, group=self.group, group_src=source)
                if self._template is None:
                    self._template = box[0]
            step_rows = sum(micro_rows)
            for micro in range(present):
                self.batch_counts.append((mine[micro], micro_rows[micro], step_rows, agreed))
                yield window[micro] if micro < len(window) else self._template

    def _keeping_template(self) -> Iterator[Any]:
        for batch in self.batches:
            if self._template is None:
                self._template = _no_rows(batch)
            yield batch
