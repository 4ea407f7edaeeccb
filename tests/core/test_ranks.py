"""Rank helpers: the rank and world size with and without a process group, rank-zero-first, rank logging."""

import io

import pytest
import torch
import torch.distributed as dist

from ddp_plugins.core import ranks
from ddp_plugins.core.ranks import (
    collective_device,
    for_collective,
    get_rank,
    get_world_size,
    rank_zero_first,
    setup_rank_logging,
)

_RANK_KEYS = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def _test_rank_zero_first_orders_ranks(rank, world_size, path):
    import time
    from pathlib import Path

    marker = Path(path)
    with rank_zero_first(timeout=30):
        entered = time.monotonic()  # one clock for every process of this machine
        if rank == 0:
            time.sleep(0.2)
            marker.write_text("prepared")
        seen = marker.exists()
        left = time.monotonic()
    return get_rank(), get_world_size(), seen, entered, left


def test_rank_zero_first_lets_rank_zero_finish_first(dist_pool, tmp_path):
    results = dist_pool.run(_test_rank_zero_first_orders_ranks, str(tmp_path / "marker"))
    assert [r[:3] for r in results] == [(0, 2, True), (1, 2, True)], "rank 1 entered before rank 0 had prepared"
    # causality, not a margin: rank 1's body began after rank 0's had ended
    assert results[1][3] >= results[0][4], "rank 1 entered while rank 0 was still in the body"


def test_single_process_helpers():
    assert not dist.is_initialized()
    assert (get_rank(), get_world_size()) == (0, 1)
    with rank_zero_first():
        ran = True
    assert ran


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, 0),
        ({"RANK": "3"}, 3),
        ({"SLURM_PROCID": "5"}, 5),
        ({"LOCAL_RANK": "1"}, 1),
        ({"LOCAL_RANK": "1", "NODE_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, 9),
        ({"RANK": "2", "LOCAL_RANK": "1"}, 2),
    ],
)
def test_rank_without_a_process_group_comes_from_the_launcher_environment(monkeypatch, env, rank):
    for key in _RANK_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert not dist.is_initialized()
    assert get_rank() == rank


def test_rank_logging_info_on_rank_zero_warning_elsewhere(monkeypatch):
    stream = io.StringIO()
    for key in _RANK_KEYS:
        monkeypatch.delenv(key, raising=False)
    logger = setup_rank_logging("ddp_plugins.test_rank_logging")
    logger.handlers[0].stream = stream
    logger.info("info on zero")
    monkeypatch.setenv("LOCAL_RANK", "1")
    logger.info("info on one")
    logger.warning("warning on one")
    assert stream.getvalue().splitlines() == [
        "[rank 0] INFO ddp_plugins.test_rank_logging: info on zero",
        "[rank 1] WARNING ddp_plugins.test_rank_logging: warning on one",
    ]
    assert len(setup_rank_logging("ddp_plugins.test_rank_logging").handlers) == 1, "a second call adds a handler"


def _test_rank_logging_follows_the_process_group(rank, world_size):
    stream = io.StringIO()
    logger = setup_rank_logging("ddp_plugins.test_pool_logging")
    logger.handlers[0].stream = stream
    logger.info("effective network env")
    logger.warning("careful")
    return stream.getvalue().splitlines()


def test_rank_logging_uses_the_process_group_rank(dist_pool):
    rank0, rank1 = dist_pool.run(_test_rank_logging_follows_the_process_group)
    assert rank0 == [
        "[rank 0] INFO ddp_plugins.test_pool_logging: effective network env",
        "[rank 0] WARNING ddp_plugins.test_pool_logging: careful",
    ]
    assert rank1 == ["[rank 1] WARNING ddp_plugins.test_pool_logging: careful"]


# ---------------------------------------------------------------- where a collective's tensors go

# On this CPU machine CUDA's presence is mocked where the rule only branches on it: the backend's
# name and the current CUDA device. A "meta" tensor stands for one on a device the backend cannot
# take, so a move shows. What no CPU test catches: a collective that a real nccl group rejects for a
# reason other than the device (a dtype, a stream), and a caller that bypasses this rule; the tests
# marked `gpu` (tests/core/test_cuda.py) run the same paths on nccl and CUDA tensors.


def _test_the_rule_on_a_gloo_group(rank, world_size):
    return str(collective_device()), str(for_collective(torch.ones(1)).device)


def test_gloo_groups_and_single_processes_collect_on_the_cpu(dist_pool):
    assert collective_device() == torch.device("cpu") and for_collective(torch.ones(1)).device.type == "cpu"
    assert dist_pool.run(_test_the_rule_on_a_gloo_group) == [("cpu", "cpu")] * 2


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", "cuda:3"), ("gloo", "cpu"), ("mpi", "cpu"), ("ucc", "cpu")],
)
def test_the_group_backend_decides_the_collective_device(monkeypatch, backend, expected):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device() == torch.device(expected)


@pytest.mark.parametrize(
    ("backend", "moved"), [("nccl", True), ("gloo", False), ("mpi", False)], ids=["nccl", "gloo", "mpi"]
)
def test_a_tensor_moves_only_where_the_backend_cannot_take_it(monkeypatch, backend, moved):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(
        ranks, "collective_device", lambda group=None: torch.device("meta" if backend == "nccl" else "cpu")
    )
    cpu = torch.ones(2)
    out = for_collective(cpu)
    assert (out.device.type == "meta") is moved, f"{backend}: a CPU tensor went to {out.device}"
    assert (out is cpu) is not moved, "a tensor the backend takes is handed on as it is, not copied"
