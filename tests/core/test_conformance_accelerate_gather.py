"""Conformance: Accelerate's ``gather_for_metrics`` / ``gather`` / ``gather_object`` tests, ported to our collectives.

Originals (huggingface/accelerate, main): ``src/accelerate/test_utils/scripts/external_deps/test_metrics.py``
(run by ``tests/test_metrics.py``), ``src/accelerate/test_utils/scripts/test_distributed_data_loop.py``,
``src/accelerate/test_utils/scripts/test_ops.py``, the ``__main__`` block of ``tests/test_multidevice.py``
and the ``split_between_processes`` + ``gather_object`` cases of ``src/accelerate/test_utils/scripts/test_script.py``.
They run on 2 gloo ranks here. Accelerate's pieces map to ours as follows: its prepared (sharded,
padded) evaluation loader is a ``DataLoader`` over :class:`SequentialDistributedSampler`; its
``gather_for_metrics`` is :func:`distributed_concat` with ``num_total_examples`` (the true length:
the padding is dropped); ``gather`` and ``gather_object`` are :func:`distributed_concat` of tensors
and of lists of objects. Every result is compared with what one process computes on the whole dataset.

Ported (original name -> test here):

* ``test_torch_metrics`` (82 and 99 samples, batch size 16; 512: "last batch is not dropped when
  perfectly divisible") and the baseline-vs-distributed comparison of ``test_mrpc``, on the same
  ``RegressionModel`` (``x * a + b``) and ``RegressionDataset`` (``y = 2x + 3 + noise``) ->
  ``test_gather_for_metrics_is_the_dataset_in_order``. Accelerate uses ``a = b = 0`` (every
  prediction 0) and only checks the length; here ``a, b = 2, 3`` so that order and duplicates show.
* ``test_gather_for_metrics_drop_last`` -> ``test_drop_last``.
* ``test_gather_for_metrics_with_iterable_dataset`` and ``..._with_non_tensor_objects_iterable_dataset``
  (30 items, batch size 4), plus strings as a third kind of item -> ``test_iterable_dataset``.
* ``test_data_loader`` with ``shuffle=False``, with ``batch_sampler=BatchSampler(...)`` and with
  ``sampler=BatchSampler(...), batch_size=None`` (``DummyDataset`` of 22 dict rows, batch size 4) ->
  ``test_data_loader``.
* ``test_default_ensures_even_batch_sizes`` -> ``test_even_batch_sizes``.
* ``test_can_disable_even_batches`` (different batch sizes per rank, a smaller last batch, a rank
  with one batch fewer) -> ``test_uneven_batches_gathered_step_by_step``.
* ``test_ops.py``: ``test_gather``, ``test_gather_object``, ``test_gather_non_contiguous``,
  ``test_pad_across_processes`` and ``test_multidevice.py``'s ``pad_across_processes`` block ->
  ``test_ops_gather``, ``test_ops_gather_object``, ``test_ops_gather_non_contiguous``,
  ``test_uneven_rows_are_concatenated_not_padded``; ``test_op_checker`` (its ``pad_across_processes``
  part) -> ``test_op_checker_shape_mismatch``.
* ``test_script.py``: ``test_split_between_processes_list``, ``..._datasets`` (rows ``{"k": v}``) and
  ``..._tensor`` with ``apply_padding=True`` on odd and even lengths -> ``test_split_with_padding_then_gather``.

Deliberately different (our behaviour is asserted):

* Padding: Accelerate's ``even_batches`` pads the last shard with samples from the *start* of the
  dataset; :class:`SequentialDistributedSampler` repeats the *last* sample (``test_even_batch_sizes``).
* ``drop_last`` drops the tail of every rank's contiguous shard, not the tail of the dataset as
  Accelerate's batch-sharded loader does (``test_drop_last``: sample 10 is dropped).
* Uneven rows: ``pad_across_processes`` pads a rank's rows with zeros (``pad_first`` at the front) so
  that ``gather`` works, and the caller must drop them; :func:`distributed_concat` concatenates ranks
  with different row counts as they are, with no padding rows at all (``pad_value`` only pads
  trailing dims; ``pad_first`` has no equivalent).
* An IterableDataset: :class:`SequentialDistributedSampler` refuses it (it cannot be split into
  contiguous shards); the stream is batch-sharded by hand and gathered step by step instead.
* A tuple mixing tensors and per-row objects: ``gather_for_metrics`` falls back to ``gather_object``,
  which flattens one level of every rank's object (``[t0, ids0, t1, ids1]``; a dict comes back as
  its keys); :func:`distributed_concat` keeps the structure: ``(all rows, all ids)``. A list of
  tensors is structure too (each element concatenated across ranks, as ``gather_for_metrics``'s
  tensor path does), not a list of rows as with ``gather_object`` (``test_mixed_and_list_structures``).
* A shape mismatch raises ``ValueError`` on every rank (Accelerate: ``DistributedOperationException``,
  only with ``debug=True``).

Left out: the ``split_batches`` / ``dispatch_batches`` variants (Accelerate's loader modes; there is
one loader here); ``test_mrpc`` itself (needs a BERT checkpoint and the GLUE download);
``shuffle=True`` / ``RandomSampler`` in ``test_data_loader`` (an evaluation sampler keeps dataset
order; shuffled sharding is ``DistributedSampler``'s job); ``num_workers=4`` there (2 CPU cores;
workers do not change what is gathered); the "no log message" checks; ``broadcast``, ``reduce``,
``copy_tensor_to_devices``, join/``even_batches`` overrides, pickling the accelerator and the
stateful-dataloader resume cases (no counterpart in our API); ``test_utils.py::test_pad_across_processes``
(nested tensors and ``dim``, single process). Already covered elsewhere, not repeated: uneven nested
dicts/tuples with strings and 0-row ranks, variable-length rows with ``pad_value`` and the other
mismatch errors in test_collectives.py; lists of per-row dicts and tuples in test_collectives_rows.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, default_collate

from ddp_plugins.core import SequentialDistributedSampler, distributed_concat

WORLD = 2

# ---------------------------------------------------------------- external_deps/test_metrics.py


class RegressionDataset(Dataset):
    """Accelerate's ``RegressionDataset`` (``y = a * x + b + N(0, 0.1)``), drawn with torch instead of numpy."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int = 42) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, generator=gen)
        self.y = a * self.x + b + 0.1 * torch.randn(length, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(torch.nn.Module):
    """Accelerate's ``RegressionModel``: ``x * a + b``."""

    def __init__(self, a: float = 2, b: float = 3) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())

    def forward(self, x):
        return x * self.a + self.b


def _test_torch_metrics(rank, world_size, num_samples, batch_size):
    dataset = RegressionDataset(length=num_samples)
    model = RegressionModel()
    loader = DataLoader(dataset, batch_size=batch_size, sampler=SequentialDistributedSampler(dataset))
    logits, targets, batch_sizes = [], [], []
    for batch in loader:
        inp, target = batch.values()
        with torch.no_grad():
            logits.append(model(inp))
        targets.append(target)
        batch_sizes.append(len(target))
    gathered = distributed_concat((torch.cat(logits), torch.cat(targets)), num_samples)
    return gathered, batch_sizes


@pytest.mark.parametrize("num_samples", [82, 99, 512])
def test_gather_for_metrics_is_the_dataset_in_order(dist_pool, num_samples):
    batch_size = 16
    results = dist_pool.run(_test_torch_metrics, num_samples, batch_size)
    dataset = RegressionDataset(length=num_samples)
    with torch.no_grad():  # the baseline: one process, the whole dataset
        baseline = RegressionModel()(dataset.x)
    per_rank = math.ceil(num_samples / WORLD)
    for rank, ((logits, targets), batch_sizes) in enumerate(results):
        assert len(logits) == num_samples, f"Unexpected number of inputs: expected {num_samples}, got {len(logits)}"
        torch.testing.assert_close(logits, baseline, rtol=0, atol=0)
        torch.testing.assert_close(targets, dataset.y, rtol=0, atol=0)
        mse = torch.nn.functional.mse_loss(logits, targets).item()
        assert math.isclose(mse, torch.nn.functional.mse_loss(baseline, dataset.y).item())
        assert sum(batch_sizes) == per_rank and batch_sizes[-1] == per_rank - batch_size * (len(batch_sizes) - 1), (
            f"rank {rank}: the last batch must be the remainder of the shard, got {batch_sizes}"
        )


def _test_drop_last(rank, world_size, num_items, per_device_batch_size):
    dataset = range(num_items)
    loader = DataLoader(
        dataset, batch_size=per_device_batch_size, sampler=SequentialDistributedSampler(dataset), drop_last=True
    )
    batches = list(loader)
    second = distributed_concat(batches[1])  # Accelerate gathers the second batch
    everything = distributed_concat(torch.cat(batches))
    return second, everything


def test_drop_last(dist_pool):
    per_device_batch_size = 5
    num_items = 10 * WORLD + 1
    results = dist_pool.run(_test_drop_last, num_items, per_device_batch_size)
    # reference: contiguous shards of ceil(21 / 2) = 11 rows, the last padded with the last sample,
    # and each shard cut into full batches of 5
    n = math.ceil(num_items / WORLD)
    padded = list(range(num_items)) + [num_items - 1] * (n * WORLD - num_items)
    shards = [padded[r * n : (r + 1) * n] for r in range(WORLD)]
    full = [shard[: len(shard) // per_device_batch_size * per_device_batch_size] for shard in shards]
    for second, everything in results:
        # "a full set of complete batches from each GPU"
        assert second.size(0) == per_device_batch_size * WORLD
        assert second.tolist() == [
            i for shard in shards for i in shard[per_device_batch_size : 2 * per_device_batch_size]
        ]
        assert everything.tolist() == [i for shard in full for i in shard]
        assert 10 not in everything.tolist(), "drop_last drops the tail of each rank's shard"


# ---------------------------------------------------------------- iterable datasets


class DummyIterableDataset(IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        yield from self.data


ITERABLE_DATA = {
    "tensors": lambda: torch.as_tensor(range(30)),  # test_gather_for_metrics_with_iterable_dataset
    "ints": lambda: list(range(30)),  # ..._with_non_tensor_objects_iterable_dataset
    "strings": lambda: [f"item{n}" for n in range(30)],  # truly non-tensor rows
}


def _test_iterable(rank, world_size, kind):
    dataset = DummyIterableDataset(ITERABLE_DATA[kind]())
    try:
        SequentialDistributedSampler(dataset)
        refused = None
    except (TypeError, ValueError) as err:
        refused = str(err)
    # every rank reads the stream and keeps every world_size-th batch, then gathers step by step
    batches = list(itertools.islice(iter(DataLoader(dataset, batch_size=4)), rank, None, world_size))
    gathered = [distributed_concat(batch) for batch in batches]
    return refused, gathered


@pytest.mark.parametrize("kind", list(ITERABLE_DATA))
def test_iterable_dataset(dist_pool, kind):
    results = dist_pool.run(_test_iterable, kind)
    expected = list(DataLoader(DummyIterableDataset(ITERABLE_DATA[kind]()), batch_size=4))  # one process
    for refused, gathered in results:
        assert refused is not None and "distributed_concat" in refused, refused
        if kind == "strings":
            assert all(isinstance(step, list) for step in gathered)
            flat = [item for step in gathered for item in step]
            assert flat == [item for batch in expected for item in batch]
        else:
            flat = torch.cat(gathered)
            assert flat.size(0) == 30
            assert torch.equal(flat, torch.cat(expected))


# ---------------------------------------------------------------- test_distributed_data_loop.py


NUM_ELEMENTS = 22
BATCH_SIZE = 4


class DummyDataset(Dataset):
    """Accelerate's ``DummyDataset``: dict rows, indexable by an int or a list of ints."""

    def __len__(self):
        return NUM_ELEMENTS

    def __getitem__(self, index):
        squeeze = isinstance(index, int)
        index = [index] if squeeze else list(index)
        batch = [{"index": i, "label": i % 2, "random_augmentation": torch.rand(1).item()} for i in index]
        return batch[0] if squeeze else batch


def _loader(kind):
    dataset = DummyDataset()
    sampler = SequentialDistributedSampler(dataset)
    if kind == "sampler":  # DataLoader(dataset, shuffle=False, batch_size=BATCH_SIZE)
        return DataLoader(dataset, sampler=sampler, batch_size=BATCH_SIZE)
    if kind == "batch_sampler":
        return DataLoader(dataset, batch_sampler=BatchSampler(sampler, batch_size=BATCH_SIZE, drop_last=False))
    # "sampler as an instance of BatchSampler"
    batches = BatchSampler(sampler, batch_size=BATCH_SIZE, drop_last=False)
    return DataLoader(dataset, sampler=batches, batch_size=None, collate_fn=default_collate)


def _test_data_loader(rank, world_size, kind):
    torch.manual_seed(rank)  # Accelerate's main(): torch.manual_seed(accelerator.process_index)
    index, label, augmentation = [], [], []
    for batch in _loader(kind):
        index.append(batch["index"])
        label.append(batch["label"])
        augmentation.append(batch["random_augmentation"])
    local = (torch.cat(index), torch.cat(label), torch.cat(augmentation))
    return distributed_concat(local, NUM_ELEMENTS), local


@pytest.mark.parametrize("kind", ["sampler", "batch_sampler", "sampler_of_batches"])
def test_data_loader(dist_pool, kind):
    results = dist_pool.run(_test_data_loader, kind)
    locals_ = [local for _, local in results]
    for (index, label, augmentation), _ in results:
        assert len(set(index.tolist())) == NUM_ELEMENTS, "duplicated samples across processes"
        assert index.tolist() == list(range(NUM_ELEMENTS))
        assert label.tolist() == [i % 2 for i in range(NUM_ELEMENTS)]
        # the per-row random values of each rank, in rank order, padding dropped
        torch.testing.assert_close(
            augmentation, torch.cat([local[2] for local in locals_])[:NUM_ELEMENTS], rtol=0, atol=0
        )


# ---------------------------------------------------------------- even / uneven batches


def _test_even_batches(rank, world_size, dataset_size, batch_size):
    sampler = SequentialDistributedSampler(range(dataset_size))
    batches = list(DataLoader(range(dataset_size), batch_size=batch_size, sampler=sampler))
    return [len(b) for b in batches], list(sampler), distributed_concat(torch.cat(batches), dataset_size)


@pytest.mark.parametrize(("dataset_size", "batch_size", "expected_batch_sizes"), [(3, 1, [1, 1]), (7, 2, [2, 2])])
def test_even_batch_sizes(dist_pool, dataset_size, batch_size, expected_batch_sizes):
    results = dist_pool.run(_test_even_batches, dataset_size, batch_size)
    n = math.ceil(dataset_size / WORLD)
    for rank, (batch_sizes, indices, gathered) in enumerate(results):
        assert batch_sizes == expected_batch_sizes, f"rank {rank}: {batch_sizes}"
        shard = [min(i, dataset_size - 1) for i in range(rank * n, (rank + 1) * n)]  # padded with the LAST sample
        assert indices == shard
        assert gathered.tolist() == list(range(dataset_size))


def _test_uneven_batches(rank, world_size, dataset_size, batch_size):
    # even_batches=False: rank r gets batches r, r + world_size, ... of the dataset; no padding
    batches = list(
        itertools.islice(iter(DataLoader(range(dataset_size), batch_size=batch_size)), rank, None, world_size)
    )
    steps = math.ceil(math.ceil(dataset_size / batch_size) / world_size)
    gathered = []
    for step in range(steps):
        # a rank without a batch at this step takes part with zero rows
        local = batches[step] if step < len(batches) else torch.empty(0, dtype=torch.long)
        gathered.append(distributed_concat(local))
    return [len(b) for b in batches], gathered


@pytest.mark.parametrize(
    ("dataset_size", "batch_size", "sizes0", "sizes1"), [(3, 1, [1, 1], [1]), (7, 2, [2, 2], [2, 1])]
)
def test_uneven_batches_gathered_step_by_step(dist_pool, dataset_size, batch_size, sizes0, sizes1):
    results = dist_pool.run(_test_uneven_batches, dataset_size, batch_size)
    assert [sizes for sizes, _ in results] == [sizes0, sizes1]
    step_sizes = [a + b for a, b in itertools.zip_longest(sizes0, sizes1, fillvalue=0)]
    for _, gathered in results:
        assert torch.cat(gathered).tolist() == list(range(dataset_size)), "rows lost, duplicated or out of order"
        assert [len(step) for step in gathered] == step_sizes, "each step holds exactly the ranks' rows, no padding"


# ---------------------------------------------------------------- test_ops.py


def _create_tensor(rank, world_size):
    """test_ops' create_tensor: [1, 2] on rank 0, [3, 4] on rank 1."""
    return torch.arange(world_size) + 1.0 + world_size * rank


def _test_gather(rank, world_size):
    return distributed_concat(_create_tensor(rank, world_size))


def test_ops_gather(dist_pool):
    expected = torch.cat([_create_tensor(r, WORLD) for r in range(WORLD)])
    for gathered in dist_pool.run(_test_gather):
        assert gathered.tolist() == list(range(1, WORLD**2 + 1))
        assert torch.equal(gathered, expected)


def _test_gather_object(rank, world_size):
    return distributed_concat([rank])


def test_ops_gather_object(dist_pool):
    for gathered in dist_pool.run(_test_gather_object):
        assert len(gathered) == WORLD and gathered == list(range(WORLD))


def _non_contiguous(rank):
    return torch.arange(12).view(4, 3).t() + 100 * rank


def _test_gather_non_contiguous(rank, world_size):
    tensor = _non_contiguous(rank)
    assert not tensor.is_contiguous()
    return distributed_concat(tensor)


def test_ops_gather_non_contiguous(dist_pool):
    expected = torch.cat([_non_contiguous(r) for r in range(WORLD)])
    for gathered in dist_pool.run(_test_gather_non_contiguous):
        assert torch.equal(gathered, expected)


def _uneven(rank, world_size):
    """test_pad_across_processes: the main process holds one more element; test_multidevice: rank + 2 rows of 10."""
    first = torch.arange(world_size + 1) if rank == 0 else torch.arange(world_size)
    rows = torch.randint(0, 10, (rank + 2, 10), generator=torch.Generator().manual_seed(rank))
    return first, rows


def _test_uneven_rows(rank, world_size):
    first, rows = _uneven(rank, world_size)
    return distributed_concat(first), distributed_concat(rows)


def test_uneven_rows_are_concatenated_not_padded(dist_pool):
    parts = [_uneven(r, WORLD) for r in range(WORLD)]
    for first, rows in dist_pool.run(_test_uneven_rows):
        assert first.tolist() == [0, 1, 2, 0, 1], "no zero padding rows between the ranks"
        assert torch.equal(first, torch.cat([p[0] for p in parts]))
        assert rows.shape == (2 + 3, 10)
        assert torch.equal(rows, torch.cat([p[1] for p in parts]))


def _test_op_checker(rank, world_size):
    cases = {
        "pad_across_processes": (
            torch.tensor([[0.0, 1, 2, 3, 4]]) if rank == 0 else torch.tensor([[[0.0, 1, 2, 3, 4, 5]]])
        ),
        "reduce": (
            torch.tensor([[0.0, 1, 2, 3, 4]]) if rank == 0 else torch.tensor([[[0.0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]])
        ),
    }
    messages = {}
    for name, tensor in cases.items():
        try:
            distributed_concat({"tensor": tensor})
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    still_in_step = torch.ones(1)
    dist.all_reduce(still_in_step)  # the group survives: no rank was left inside a collective
    return messages, still_in_step.item()


def test_op_checker_shape_mismatch(dist_pool):
    results = dist_pool.run(_test_op_checker)
    for messages, total in results:
        assert total == WORLD
        for name, message in messages.items():
            assert message is not None, f"{name}: different numbers of dims across ranks must raise"
            assert "same number of dims" in message and "rank 0" in message and "rank 1" in message, message
    assert results[0][0] == results[1][0], "every rank raises the same error"


# -------------------------------------------------------------- test_script.py: split_between_processes + gather_object


SPLIT_DATA = {
    "list": lambda n: list(range(n)),
    "datasets": lambda n: [{"k": v} for v in range(n)],
    "tensor": lambda n: torch.tensor([[i] for i in range(n)]),
}


def _test_split(rank, world_size, kind, n):
    data = SPLIT_DATA[kind](n)
    sampler = SequentialDistributedSampler(range(n))  # apply_padding=True: the last item repeated
    indices = list(sampler)
    results = data[indices] if kind == "tensor" else [data[i] for i in indices]
    return len(results), distributed_concat(results, n)


@pytest.mark.parametrize("kind", list(SPLIT_DATA))
@pytest.mark.parametrize("n", [2 * WORLD - 1, 2 * WORLD], ids=["odd", "even"])
def test_split_with_padding_then_gather(dist_pool, kind, n):
    expected = SPLIT_DATA[kind](n)
    for length, output in dist_pool.run(_test_split, kind, n):
        assert length == math.ceil(n / WORLD), "every process gets the same number of items"
        if kind == "tensor":
            assert torch.equal(output, expected)
        else:
            assert output == expected


# ---------------------------------------------------------------- structures that differ from gather_object


def _mixed(rank):
    rows = rank + 1
    return (
        torch.arange(rows) + 10 * rank,
        [f"id{rank}-{i}" for i in range(rows)],
        [torch.full((rows, 2), rank), torch.ones(1) * rank],
    )


def _test_mixed(rank, world_size):
    logits, ids, pair = _mixed(rank)
    return distributed_concat((logits, ids)), distributed_concat(pair)


def test_mixed_and_list_structures(dist_pool):
    parts = [_mixed(r) for r in range(WORLD)]
    for (logits, ids), pair in dist_pool.run(_test_mixed):
        # gather_for_metrics -> gather_object would give [logits0, ids0, logits1, ids1]
        assert torch.equal(logits, torch.cat([p[0] for p in parts]))
        assert ids == [i for p in parts for i in p[1]]
        # a list of tensors is structure: element by element, concatenated across ranks
        assert isinstance(pair, list) and len(pair) == 2
        assert torch.equal(pair[0], torch.cat([p[2][0] for p in parts]))
        assert torch.equal(pair[1], torch.cat([p[2][1] for p in parts]))
