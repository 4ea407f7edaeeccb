"""SequentialDistributedSampler: contiguous, equal shards that concatenate to the dataset (no process group needed)."""

import doctest

import pytest
from torch.utils.data import IterableDataset

import ddp_plugins.core.samplers
from ddp_plugins.core.samplers import SequentialDistributedSampler


@pytest.mark.parametrize("n", [0, 1, 3, 5, 1001])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sampler_gives_contiguous_equal_shards_that_concatenate_to_the_dataset(n, world_size):
    samplers = [SequentialDistributedSampler(range(n), num_replicas=world_size, rank=r) for r in range(world_size)]
    shards = [list(s) for s in samplers]
    assert len({len(shard) for shard in shards}) == 1, "every rank must run the same number of samples"
    assert all(len(shard) == len(s) for shard, s in zip(shards, samplers, strict=True))
    assert sum(s.num_real_samples for s in samplers) == n, "real samples must cover the dataset exactly once"
    flat = [i for shard in shards for i in shard]
    assert flat[:n] == list(range(n)), "concatenated shards are not the dataset in order"
    for shard, s in zip(shards, samplers, strict=True):
        assert shard[: s.num_real_samples] == sorted(set(shard[: s.num_real_samples])), "a shard is not contiguous"


def test_sampler_rejects_an_iterable_dataset():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError, match="IterableDataset cannot be split"):
        SequentialDistributedSampler(Stream(), num_replicas=2, rank=0)


def test_docstring_examples_run():
    assert doctest.testmod(ddp_plugins.core.samplers).failed == 0


def test_padding_apart_sampler_keeps_padding_out_of_real_batches_and_gives_every_rank_as_many_batches():
    from ddp_plugins.core.samplers import PaddingApartSampler

    for length in range(1, 40):
        for ranks in range(1, 6):
            for batch in range(1, 8):
                samplers = [PaddingApartSampler(range(length), ranks, rank, batch) for rank in range(ranks)]
                real = [i for s in samplers for i in list(s)[: s.num_real_samples]]
                assert real == list(range(length)), f"{length} rows, {ranks} ranks, batch {batch}: not in order once"
                counts = {-(-len(list(s)) // batch) for s in samplers}
                assert len(counts) == 1, f"{length} rows, {ranks} ranks, batch {batch}: batches per rank {counts}"
                for s in samplers:
                    indices = list(s)
                    assert len(indices) == s.num_samples
                    for k, first in enumerate(range(0, len(indices), batch)):
                        rows = indices[first : first + batch]
                        mine = range(s.start, s.start + s.num_real_samples)
                        if s.is_padding(k):
                            assert rows == [length - 1] * len(rows), f"a padding batch holds {rows}"
                        else:
                            assert all(i in mine for i in rows), f"rank {s.rank} batch {k} mixes padding: {rows}"
