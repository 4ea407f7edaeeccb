"""distributed_concat gathers lists of per-row dicts and tuples, as Accelerate's gather_for_metrics does."""


def _test_rows_of_dicts_and_tuples(rank, world_size):
    from ddp_plugins.core import distributed_concat

    records = [{"id": f"r{rank}-{i}", "score": rank + i / 10} for i in range(rank + 1)]
    pairs = [(rank, i) for i in range(2 - rank)]
    return distributed_concat({"records": records, "pairs": pairs}, None)


def test_distributed_concat_gathers_per_row_dicts_and_tuples_in_rank_order(dist_pool):
    for result in dist_pool.run(_test_rows_of_dicts_and_tuples):
        assert result["records"] == [
            {"id": "r0-0", "score": 0.0},
            {"id": "r1-0", "score": 1.0},
            {"id": "r1-1", "score": 1.1},
        ]
        assert result["pairs"] == [(0, 0), (0, 1), (1, 0)]
