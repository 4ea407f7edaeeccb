"""The reproducible mode's rounding grid is fixed by the plan's shard count, never by the ranks (issue 43).

``exact_row_sum`` runs three pure stages with an ``all_reduce`` between them: each rank's ``Grid`` of
largest magnitudes (combined by MAX), each rank's integer sum on the agreed grid (combined by SUM), and
the way back. The first test runs those stages for V = 8 shards split over every N from 1 to 8 as the
plan splits them (3 ranks hold 3 + 3 + 2 shards), combining the ranks' parts as the collectives do,
and needs the same bits on every N; the second runs the real collectives on 2 gloo ranks.
"""

from __future__ import annotations

import torch

from ddp_plugins.core.plan import GlobalPlan
from ddp_plugins.core.reproducible import Grid, exact_row_sum

V = 8
SIZES = [5, 1, 3, 0, 4]  # a tensor of no values too


def _shards() -> tuple[list[torch.Tensor], list[float], list[bool]]:
    """V float64 rows (64-true: every bit of the grid shows) of wide magnitudes; shards 2 and 6 are
    empty (no rows: weight 0, zeros), and tensor 4 is given by no shard at all."""
    g = torch.Generator().manual_seed(7)
    rows, weights = [], []
    for shard in range(V):
        scales = torch.cat([torch.full((n,), 10.0 ** float(torch.randint(-8, 8, (1,), generator=g))) for n in SIZES])
        row = torch.randn(sum(SIZES), generator=g, dtype=torch.float64) * scales
        row[-SIZES[-1] :] = 0
        empty = shard in (2, 6)
        rows.append(torch.zeros_like(row) if empty else row)
        weights.append(0.0 if empty else float(torch.randint(1, 9, (1,), generator=g)))
    return rows, weights, [True, True, True, True, False]


def _simulated(world_size: int, total_shards: int = V) -> torch.Tensor:
    """What ``exact_row_sum`` returns on ``world_size`` ranks, the collectives done by hand."""
    rows, weights, present = _shards()
    rows = torch.stack(rows)
    split = GlobalPlan(64, 32, virtual_shards=V).rank_shards(world_size)
    ranks = [(rows[a:b], weights[a:b]) for a, b in split]
    mine = [Grid.of(r, w, SIZES, torch.tensor(present)).packed for r, w in ranks]
    grid = Grid(torch.stack(mine).amax(dim=0), SIZES)  # MAX
    integers = [grid.integers(r, w, total_shards) for r, w in ranks]
    return grid.values(torch.stack(integers).sum(dim=0), total_shards)  # SUM


def test_the_grid_is_the_same_for_every_split_of_the_shards():
    one = _simulated(1)
    rows, weights, _ = _shards()
    direct = sum(w * r for w, r in zip(weights, rows, strict=True))
    torch.testing.assert_close(one, direct, rtol=1e-12, atol=0)  # the sum itself, to the grid's rounding
    for world_size in range(2, V + 1):
        got = _simulated(world_size)
        assert torch.equal(got, one), f"{world_size} ranks round differently: {(got - one).abs().max()}"
    # the test can fail: a grid sized for 9 shards (3 ranks x 3, the rule that failed) rounds otherwise
    assert not torch.equal(_simulated(3, total_shards=9), one), "the grid's width does not show in float64"


def _test_two_ranks(rank, world_size):
    rows, weights, present = _shards()
    rows = torch.stack(rows)
    a, b = GlobalPlan(64, 32, virtual_shards=V).rank_shards(world_size)[rank]
    summed = exact_row_sum(rows[a:b], weights[a:b], SIZES, torch.tensor(present), V)
    return summed.sums, summed.present


def test_the_collectives_give_the_simulated_bits(dist_pool):
    for sums, there in dist_pool.run(_test_two_ranks):
        assert torch.equal(sums, _simulated(1)), "2 gloo ranks differ from one process"
        assert there.tolist() == [True, True, True, True, False]
