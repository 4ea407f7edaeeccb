"""distributed_concat on 2 gloo ranks: uneven, nested, ragged data gathered like one process, clear errors."""

import doctest

import pytest
import torch
import torch.distributed as dist

import ddp_plugins.core.collectives
from ddp_plugins.core.collectives import distributed_concat
from ddp_plugins.core.samplers import SequentialDistributedSampler

PAD = -100


def _test_sampler_then_concat(rank, world_size, n):
    sampler = SequentialDistributedSampler(range(n))  # world size and rank from the process group
    rows = torch.tensor(list(sampler))
    return distributed_concat({"idx": rows, "ids": [f"s{i}" for i in sampler]}, n), sampler.num_real_samples


@pytest.mark.parametrize("n", [1001, 1])
def test_concat_of_sampler_shards_is_the_dataset_in_order(dist_pool, n):
    results = dist_pool.run(_test_sampler_then_concat, n)
    for gathered, _ in results:
        assert torch.equal(gathered["idx"], torch.arange(n)), "padding not dropped or order wrong"
        assert gathered["ids"] == [f"s{i}" for i in range(n)]
    assert sum(real for _, real in results) == n
    if n == 1:
        assert results[1][1] == 0, "the dataset is smaller than the world: rank 1 holds only padding"


def _rank_data(rank):
    """Uneven nested data: rank 0 has 3 rows, rank 1 none."""
    rows = 3 if rank == 0 else 0
    base = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 100 * rank
    return {
        "a": {"x": base, "mask": base > 5},
        "pair": (base.long(), base.to(torch.bfloat16)),
        "ids": [f"r{rank}-{i}" for i in range(rows)],
    }


def _test_concat_uneven_nested(rank, world_size):
    return distributed_concat(_rank_data(rank))


def test_concat_handles_uneven_rows_zero_rows_nested_structures_dtypes_and_strings(dist_pool):
    results = dist_pool.run(_test_concat_uneven_nested)
    parts = [_rank_data(r) for r in range(2)]  # what one process would concatenate
    for got in results:
        assert torch.equal(got["a"]["x"], torch.cat([p["a"]["x"] for p in parts]))
        assert torch.equal(got["a"]["mask"], torch.cat([p["a"]["mask"] for p in parts]))
        assert got["a"]["mask"].dtype == torch.bool
        assert torch.equal(got["pair"][0], torch.cat([p["pair"][0] for p in parts]))
        assert got["pair"][1].dtype == torch.bfloat16
        assert torch.equal(got["pair"][1], torch.cat([p["pair"][1] for p in parts]))
        assert isinstance(got["pair"], tuple)
        assert got["ids"] == ["r0-0", "r0-1", "r0-2"]


def _ragged(rank):
    return torch.arange(6).reshape(2, 3) if rank == 0 else torch.arange(15).reshape(3, 5) + 50


def _test_concat_ragged(rank, world_size):
    return distributed_concat(_ragged(rank), 4, pad_value=PAD)


def test_concat_pads_variable_length_rows_and_truncates(dist_pool):
    expected = torch.full((5, 5), PAD)
    expected[:2, :3] = _ragged(0)
    expected[2:, :] = _ragged(1)
    for got in dist_pool.run(_test_concat_ragged):
        assert torch.equal(got, expected[:4]), "variable-length rows not padded and truncated like one process"


def _test_concat_errors(rank, world_size):
    cases = {
        "dtype": torch.zeros(2, 3, dtype=torch.float32 if rank == 0 else torch.float64),
        "structure": {"a": torch.zeros(2)} if rank == 0 else {"b": torch.zeros(2)},
        "trailing": torch.zeros(2, 3 + rank),
        "type": {"a": torch.zeros(2), "n": 3} if rank == 1 else {"a": torch.zeros(2), "n": [3, 4]},
    }
    messages = {}
    for name, data in cases.items():
        try:
            distributed_concat(data)
            messages[name] = None
        except (ValueError, TypeError) as exc:
            messages[name] = str(exc)
    still_in_step = torch.ones(1)
    dist.all_reduce(still_in_step)  # the group survives every error: no rank is left inside a collective
    return messages, still_in_step.item()


def test_concat_mismatches_raise_a_clear_error_on_every_rank_without_hanging(dist_pool):
    results = dist_pool.run(_test_concat_errors)
    for messages, total in results:
        assert total == 2.0, "ranks fell out of step after an error"
        assert "rank 0: data float32[2, 3]" in messages["dtype"] and "rank 1: data float64[2, 3]" in messages["dtype"]
        assert "different structure" in messages["structure"] and "'a'" in messages["structure"]
        assert "pad_value" in messages["trailing"] and "float32[2, 4]" in messages["trailing"]
        assert "rank 1" in messages["type"] and "got int" in messages["type"]
    assert results[0][0] == results[1][0], "both ranks must raise the same error"


def _test_local_error(rank, world_size):
    error = "the step output of batch 3 has no rows" if rank == 1 else None
    try:
        distributed_concat({"x": torch.ones(2, 3)}, local_error=error)
        message = None
    except ValueError as exc:
        message = str(exc)
    still_in_step = torch.ones(1)
    dist.all_reduce(still_in_step)
    return message, still_in_step.item()


def test_a_local_error_is_raised_on_every_rank_together(dist_pool):
    for message, total in dist_pool.run(_test_local_error):
        assert message == "rank 1: the step output of batch 3 has no rows", message
        assert total == 2.0, "ranks fell out of step after the error"


def test_concat_without_process_group_truncates_and_validates():
    assert distributed_concat([torch.arange(3)], 2)[0].tolist() == [0, 1]
    with pytest.raises(ValueError, match="`num_total_examples` should be an integer >= 0 or None, got -1\\."):
        distributed_concat(torch.arange(3), -1)
    with pytest.raises(ValueError, match="^found on this rank$"):
        distributed_concat(torch.arange(3), local_error="found on this rank")


def test_docstring_examples_run():
    assert doctest.testmod(ddp_plugins.core.collectives).failed == 0
