"""distributed_concat's shapes-with-data round gives what the full metadata exchange gives, in fewer collectives.

Each case runs twice on the same 2 gloo ranks: through :func:`distributed_concat` (shapes travel with the
data, falling back to the full exchange for Python rows and disagreeing ranks) and through
``_gather_with_metadata``, the full exchange alone (every rank's metadata in one object gather, then one
gather per tensor). Results, and errors word for word, must be the same; the collectives are counted.
"""

import torch
import torch.distributed as dist

from ddp_plugins.core.collectives import _flatten, _gather_with_metadata, _unflatten, distributed_concat
from tests.helpers.collectives import count_collectives

SINGLE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
PAD = -7


def _full_exchange(data, pad_value=None):
    """The full metadata exchange alone, as distributed_concat did every call before the fast path."""
    spec, leaves = _flatten(data)
    return _unflatten(data, iter(_gather_with_metadata(spec, leaves, None, pad_value, None)))


def _counted(fn, *args, **kwargs):
    with count_collectives((SINGLE, "all_gather", "all_gather_object")) as counts:
        try:
            result = fn(*args, **kwargs)
        except ValueError as exc:
            result = f"ValueError: {exc}"
    return result, counts.calls[SINGLE], counts.calls["all_gather_object"]


def _cases(rank):
    nested = lambda rows: {  # noqa: E731
        "x": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 100 * rank,
        "pair": (torch.arange(rows) + 10 * rank, torch.ones(rows, 2, dtype=torch.bfloat16) * rank),
        "mask": torch.arange(rows) % 2 == rank,
    }
    return {
        # same shapes on every rank: one collective, the data inline
        "equal": (nested(4), None),
        # again, now that the group agreed on a buffer size
        "equal again": (nested(4), None),
        # more rows than the agreed buffer holds on one rank: shapes first, then the data
        "one rank grows": (nested(4 if rank else 3000), None),
        # more than the inline limit (1 MiB per rank): shapes first, then one in-place gather
        "large": (torch.full((300_000,), float(rank)), None),
        "uneven": (nested(3 + 2 * rank), None),
        "empty rank": (nested(0 if rank else 5), None),
        "ragged": (torch.arange(6 * (rank + 1)).reshape(2, 3 * (rank + 1)), PAD),
        # Python rows: the full exchange
        "strings": ({"x": torch.ones(2, 2) * rank, "ids": [f"r{rank}-{i}" for i in range(rank + 1)]}, None),
        # disagreeing ranks: the same one-line errors naming every rank's shapes
        "trailing": (torch.zeros(2, 3 + rank), None),
        "dtype": (torch.zeros(2, 3, dtype=torch.float32 if rank == 0 else torch.float64), None),
        "dims": (torch.zeros(2, 3) if rank == 0 else torch.zeros(2, 3, 1), None),
        "structure": ({"a": torch.zeros(2)} if rank == 0 else {"b": torch.zeros(2)}, None),
        "scalar": (torch.tensor(1.0), None),
    }


def _test_fast_path_against_full_exchange(rank, world_size):
    out = {}
    for name, (data, pad_value) in _cases(rank).items():
        out[name] = {
            "fast": _counted(distributed_concat, data, pad_value=pad_value),
            "full": _counted(_full_exchange, data, pad_value),
            "truncated": _counted(distributed_concat, data, 3, pad_value=pad_value),
        }
    still_in_step = torch.ones(1)
    dist.all_reduce(still_in_step)
    return out, still_in_step.item()


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_fast_path_and_fallback_give_what_the_full_exchange_gives_in_fewer_collectives(dist_pool):
    results = dist_pool.run(_test_fast_path_against_full_exchange)
    (rank0, in_step0), (rank1, in_step1) = results
    assert in_step0 == in_step1 == 2.0, "ranks fell out of step after an error"
    for name in rank0:
        for variant in ("fast", "full", "truncated"):
            assert _same(rank0[name][variant][0], rank1[name][variant][0]), f"{name}: ranks got different results"
        fast, fast_rounds, fast_objects = rank0[name]["fast"]
        full, full_rounds, full_objects = rank0[name]["full"]
        assert _same(fast, full), f"{name}: the fast path gave {fast!r}, the full exchange {full!r}"
        assert full_objects == 1
        if name in ("strings", "dtype", "dims", "structure"):  # fallback: one shapes round, then the full exchange
            assert (fast_rounds, fast_objects) == (1 + full_rounds, 1), (name, fast_rounds, fast_objects)
        else:  # no object gather, and fewer rounds than the full exchange (an object gather is two)
            assert fast_objects == 0 and fast_rounds + 2 * fast_objects < full_rounds + 2 * full_objects, name
    tensor_only = ("equal again", "uneven", "empty rank", "ragged", "trailing", "scalar")
    assert all(rank0[name]["fast"][1] == 1 for name in tensor_only), "data that fits the agreed buffer takes one round"
    assert rank0["one rank grows"]["fast"][1] == 1 + 4, "a shapes round, then one gather per tensor"
    assert rank0["large"]["fast"][1] == 2, "a shapes round, then one gather in place"
    # the results themselves, against one process's concatenation
    parts = [_cases(r) for r in range(2)]
    expected_x = torch.cat([p["uneven"][0]["x"] for p in parts])
    assert torch.equal(rank0["uneven"]["fast"][0]["x"], expected_x)
    assert torch.equal(rank0["uneven"]["truncated"][0]["x"], expected_x[:3])
    assert rank0["uneven"]["fast"][0]["pair"][1].dtype == torch.bfloat16
    assert torch.equal(rank0["large"]["fast"][0], torch.cat([p["large"][0] for p in parts]))
    ragged = rank0["ragged"]["fast"][0]
    assert ragged.shape == (4, 6) and (ragged[:2, 3:] == PAD).all() and torch.equal(ragged[2:], parts[1]["ragged"][0])
    assert rank0["strings"]["fast"][0]["ids"] == ["r0-0", "r1-0", "r1-1"]
    # disagreeing ranks: the same one-line message, naming both ranks' shapes, on both ranks
    for name, shown in {
        "trailing": ("rank 0: data float32[2, 3]", "rank 1: data float32[2, 4]"),
        "dtype": ("rank 0: data float32[2, 3]", "rank 1: data float64[2, 3]"),
        "dims": ("rank 0: data float32[2, 3]", "rank 1: data float32[2, 3, 1]"),
        "scalar": ("rank 0: data float32[]", "rank 1: data float32[]"),
        "structure": ("rank 0: ('dict', ((\"'a'\", 'leaf'),))", "rank 1: ('dict', ((\"'b'\", 'leaf'),))"),
    }.items():
        message = rank0[name]["fast"][0]
        assert message.startswith("ValueError: `data`") and "\n" not in message, message
        assert all(part in message for part in shown), message
        assert message == rank1[name]["fast"][0] == rank0[name]["full"][0], f"{name}: the message changed"


def _repeated_calls(rank):
    """Calls in the order a loop makes them: (this rank's tensor) per call."""
    x = lambda rows, seed: torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 100 * rank + seed  # noqa: E731
    return [
        x(4, 0),  # planned, then remembered by its signature
        x(4, 1),  # the same signature: the remembered plan, fresh values
        x(4, 2) if rank == 0 else x(5, 2),  # rank 0 repeats, rank 1 does not: rank 0 reads the headers after all
        x(4, 3),
        x(2, 4),  # a second signature
        x(4, 5),  # the first again
        x(2, 6),
        x(4, 7).requires_grad_(),
    ]


def _test_repeated_calls(rank, world_size):
    out = []
    for data in _repeated_calls(rank):
        result, rounds, objects = _counted(distributed_concat, data)
        out.append((result.detach(), rounds, objects))
    return out


def test_calls_that_repeat_a_signature_give_fresh_values_and_notice_a_rank_that_changed(dist_pool):
    results = dist_pool.run(_test_repeated_calls)
    calls = [_repeated_calls(r) for r in range(2)]
    for rank, out in enumerate(results):
        for i, (result, rounds, objects) in enumerate(out):
            expected = torch.cat([calls[0][i], calls[1][i]]).detach()
            assert torch.equal(result, expected), f"rank {rank}, call {i}: {result} != {expected}"
            assert (rounds, objects) == (1, 0), f"rank {rank}, call {i}: {rounds} rounds, {objects} object gathers"
