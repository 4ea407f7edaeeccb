"""The global plan: every row once per epoch, in one order for any world size, shares as even as possible."""

import pickle
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.core.plan import EmptyShareCollate, EvenSteps, GlobalPlan, PlanBatchSampler, even_split

CASES = [(23, 8), (23, 5), (7, 16), (64, 64), (1438, 64)]


@pytest.mark.parametrize(
    "length,g,drop_last", [(n, g, False) for n, g in CASES] + [(n, g, True) for n, g in CASES if g <= n]
)
def test_every_row_once_per_epoch_in_one_order_for_any_world_size_and_accumulation(length, g, drop_last):
    plan = GlobalPlan(length, g, seed=3, drop_last=drop_last)
    for epoch in (0, 1):
        order = plan.order(epoch)
        kept = order[: plan.steps_per_epoch * g] if drop_last else order
        for world in (1, 2, 3, 5):
            for k in (1, 2, 3):
                per_rank = [list(PlanBatchSampler(plan, r, world, k, epoch=epoch)) for r in range(world)]
                assert {len(b) for b in per_rank} == {plan.steps_per_epoch * k}, "ranks run different step counts"
                trained = []
                for step in range(plan.steps_per_epoch):
                    micro = [b[step * k : (step + 1) * k] for b in per_rank]
                    shares = [sum(len(m) for m in rank_micro) for rank_micro in micro]
                    assert max(shares) - min(shares) <= 1, f"shares {shares} are not as even as possible"
                    unions = [[i for rank_micro in micro for i in rank_micro[m]] for m in range(k)]
                    rows = [i for union in unions for i in union]
                    assert rows == plan.step_indices(epoch, step), "a step is not the plan's rows in order"
                    # micro-batch m holds the same rows on every world size (one process's m-th micro-batch)
                    assert unions == [plan.micro_batches(epoch, step, 0, 1, k)[m] for m in range(k)]
                    counts = plan.counts(step, world, k)
                    assert [[len(m) for m in rank_micro] for rank_micro in micro] == counts
                    weights = [plan.loss_weight(step, m, r, world, k) for r in range(world) for m in range(k)]
                    assert sum(weights) == pytest.approx(world * k)  # DDP's mean of K-divided losses: one mean
                    trained += rows
                assert trained == kept, f"epoch {epoch}, {world} ranks, K={k}: rows padded, dropped or repeated"
        assert sorted(order) == list(range(length))
    assert plan.order(0) != plan.order(1), "the order does not change between epochs"


def test_a_resumed_epoch_starts_at_the_step_and_the_next_epoch_is_whole():
    plan = GlobalPlan(20, 6, seed=1)
    full = list(PlanBatchSampler(plan, 1, 2, 2, epoch=4))
    resumed = PlanBatchSampler(plan, 1, 2, 2, epoch=4, start_step=2)
    assert list(resumed) == full[4:]
    assert list(resumed) == full and len(resumed) == len(full) == 8
    sampler = PlanBatchSampler(plan, 0, 1)
    sampler.sampler.set_epoch(3)  # Lightning sets the epoch on a loader's `batch_sampler.sampler`
    assert [i for b in sampler for i in b] == plan.order(3) == list(sampler.sampler)


def test_the_plan_refuses_bad_values_with_the_argument_named():
    with pytest.raises(ArgumentValueError, match="global_batch_size"):
        GlobalPlan(10, 0)
    with pytest.raises(ArgumentValueError, match="global_batch_size.*at most the dataset's 10 rows"):
        GlobalPlan(10, 11, drop_last=True)
    with pytest.raises(ArgumentValueError, match="start_step"):
        PlanBatchSampler(GlobalPlan(10, 5), 0, 2, start_step=3)
    with pytest.raises(ArgumentValueError, match="rank"):
        PlanBatchSampler(GlobalPlan(10, 5), 2, 2)


def test_even_split():
    for n in range(12):
        for parts in range(1, 6):
            split = even_split(n, parts)
            assert sum(split) == n and max(split) - min(split) <= 1 and split == sorted(split, reverse=True)


Pair = namedtuple("Pair", "x y")


def test_an_empty_share_is_a_zero_row_batch_of_the_same_structure_also_from_workers():
    x, y = torch.randn(5, 3, 2, dtype=torch.float64), torch.arange(5)
    dataset = TensorDataset(x, y)
    collate = pickle.loads(pickle.dumps(EmptyShareCollate(default_collate, dataset[0])))
    empty = collate([])
    assert [t.shape for t in empty] == [(0, 3, 2), (0,)] and [t.dtype for t in empty] == [x.dtype, y.dtype]
    full = collate([dataset[0], dataset[1]])
    assert torch.equal(full[0], x[:2])
    nested = EmptyShareCollate(default_collate, {"a": Pair(torch.ones(2), 1.5), "n": "name"})([])
    assert nested["a"].x.shape == (0, 2) and isinstance(nested["a"], Pair) and nested["n"] == ["name"]
    plan = GlobalPlan(3, 3, shuffle=False)
    sampler = PlanBatchSampler(plan, 2, 4)  # ranks 3 of 4 get nothing: [[0], [1], [2], []]
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=EmptyShareCollate(default_collate, dataset[0]))
    assert [b[1].tolist() for b in loader] == [[2]]
    last = PlanBatchSampler(plan, 3, 4)
    loader = DataLoader(
        dataset, batch_sampler=last, num_workers=1, collate_fn=EmptyShareCollate(default_collate, dataset[0])
    )
    assert [tuple(b[0].shape) for b in loader] == [(0, 3, 2)]


def _test_even_steps(rank, world_size):
    # rank 0: 3 batches of dicts; rank 1: none at all (its template comes from rank 0)
    shard = [{"x": torch.full((n, 2), float(rank)), "name": "a"} for n in ((2, 3, 1) if rank == 0 else ())]
    fetched = []  # rank 1 raises flag 15 from its second step on, rank 0 raises 2 at its third

    def flag():
        fetched.append(None)
        return {0: 2 if len(fetched) % 4 == 3 else 0, 1: 15 if len(fetched) % 4 >= 2 else 0}[rank]

    steps = EvenSteps(shard, rows_of=lambda b: len(b["x"]), flag=flag)
    epochs = [[(tuple(b["x"].shape), b["name"]) for b in steps] for _ in range(2)]
    return epochs, list(steps.batch_counts)


def test_even_steps_end_together_with_zero_row_batches_from_a_rank_that_had_none(dist_pool):
    (r0, s0), (r1, s1) = dist_pool.run(_test_even_steps)
    assert r0 == [[((2, 2), "a"), ((3, 2), "a"), ((1, 2), "a")]] * 2
    assert r1 == [[((0, 2), "a")] * 3] * 2, "rank 1 must step with rank 0 on zero-row batches of its structure"
    # the counts, and the largest flag of the step's round, the same on both ranks
    assert s0 == [(2, 2, 2, 0), (3, 3, 3, 15), (1, 1, 1, 15)] and s1 == [(0, 2, 2, 0), (0, 3, 3, 15), (0, 1, 1, 15)]


def _test_even_windows(rank, world_size):
    # rank 0: batches of 2, 3 and 1 rows; rank 1: one batch of 4 rows; 2 micro-batches per step
    shard = [torch.ones(n, 2) for n in ((2, 3, 1) if rank == 0 else (4,))]
    steps = EvenSteps(shard, window=2, length=3)
    epoch = [len(b) for b in steps]
    counted = list(steps.batch_counts)
    resumed = EvenSteps(shard, window=2, length=3, start=2)  # a resume after the first step
    return epoch, counted, [[len(b) for b in resumed] for _ in range(2)], list(resumed.batch_counts), len(resumed)


def test_even_steps_count_a_whole_accumulation_window_in_one_round_and_resume_inside_an_epoch(dist_pool):
    (e0, c0, r0, s0, n0), (e1, c1, r1, s1, n1) = dist_pool.run(_test_even_windows)
    assert e0 == [2, 3, 1] and e1 == [4, 0, 0]
    # (this rank's rows, the micro-batch's rows, the step's rows, flag): weights exact over the window
    assert c0 == [(2, 6, 9, 0), (3, 3, 9, 0), (1, 1, 1, 0)] and c1 == [(4, 6, 9, 0), (0, 3, 9, 0), (0, 1, 1, 0)]
    # resumed after step 1: each rank skips its own first 2 batches, once; the next epoch is whole
    assert r0 == [[1], [2, 3, 1]] and r1 == [[0], [4, 0, 0]] and n0 == n1 == 3
    assert s0 == c0 and s1 == c1
