"""The reproducible core from raw torch: 2 ranks give one process's bits, on the CPU and on one GPU (issue 51).

``ShardedStep`` drives a small CNN with BatchNorm and dropout through three SGD-with-momentum steps of
``G`` rows cut into ``V`` shards: one process runs every shard; 2 gloo ranks run the plan's halves. The
parameters, BatchNorm buffers, momentum and the steps' logged means must be bitwise equal. The CPU case
runs in ``make test`` (one process: the test's own; the 2 ranks: the session's gloo pool); the CUDA case,
2 ranks sharing ``cuda:0`` over gloo (nccl refuses two ranks on one GPU) against one process on it, is
marked ``gpu`` (``make gpu-check``).
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

from ddp_plugins.core.plan import GlobalPlan
from ddp_plugins.core.reproducible import ShardedStep
from ddp_plugins.testing import spawn
from tests.helpers.rng import Isolated

V, G, STEPS = 8, 32, 3


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2), nn.Linear(288, 4)
    ).to(device)


def _train(rank: int, world_size: int, device: str, shards: int = V) -> bytes:
    """This rank's state after the steps, with the steps' combined losses, as bytes (CPU copies); on one
    CPU thread, as the Lightning mode runs (a convolution's CPU kernels sum in another order on more);
    the process's global RNGs and threads as they were."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Isolated():
            return _train_isolated(rank, world_size, device, shards)
    finally:
        torch.set_num_threads(threads)


def _train_isolated(rank: int, world_size: int, device: str, shards: int) -> bytes:
    rows_per_shard = G // shards
    where = torch.device(device)
    model = _model(where).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = ShardedStep(model, shards, seed=5)
    g = torch.Generator().manual_seed(1)
    first, stop = GlobalPlan(G * STEPS, G, shuffle=False, virtual_shards=shards).rank_shards(world_size)[rank]
    losses = []
    for index in range(STEPS):
        x, y = torch.randn(G, 3, 6, 6, generator=g).to(where), torch.randint(0, 4, (G,), generator=g).to(where)
        values = []
        for shard in range(first, stop):
            rows = slice(shard * rows_per_shard, (shard + 1) * rows_per_shard)
            with step.shard(shard, rows=rows_per_shard, epoch=0, step=index):
                loss = cross_entropy(model(x[rows]), y[rows])
                loss.backward()
            values.append([loss.detach()])
        losses.append(step.finish(step_rows=G, values=values)[0])
        step.apply()
        optimizer.step()
        optimizer.zero_grad()
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    buffer = io.BytesIO()
    torch.save({"state": state, "momentum": [m.cpu() for m in momentum], "losses": [v.cpu() for v in losses]}, buffer)
    return buffer.getvalue()


def _loaded(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


def _assert_same_bits(got: dict, one: dict, where: str) -> None:
    for name, value in one["state"].items():
        assert torch.equal(got["state"][name], value), f"{where}: {name} differs from one process"
    for i, (a, b) in enumerate(zip(got["momentum"], one["momentum"], strict=True)):
        assert torch.equal(a, b), f"{where}: momentum {i} differs from one process"
    assert all(torch.equal(a, b) for a, b in zip(got["losses"], one["losses"], strict=True)), f"{where}: losses"


def _one_process(device: str, shards: int = V) -> bytes:
    """One process's run: this test process on the CPU (no process group here), a spawned one on a GPU."""
    if device == "cpu":
        return _train(0, 1, device, shards)
    return spawn(_train, device, shards, world_size=1, timeout=120)[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_two_ranks_give_one_process_bits(device, request):
    one = _loaded(_one_process(device))
    if device == "cpu":  # the session's two gloo ranks (tests/conftest.py's dist_pool)
        results = request.getfixturevalue("dist_pool").run(_train, device, timeout=120)
    else:
        results = spawn(_train, device, world_size=2, timeout=120)
    ranks = [_loaded(r) for r in results]
    assert one["state"]["1.num_batches_tracked"] == STEPS * V, "each shard's BatchNorm update, in shard order"
    for rank, got in enumerate(ranks):
        _assert_same_bits(got, one, f"rank {rank} of 2 on {device}")
    # the comparison can fail: the same steps as one shard of G rows (BatchNorm over G rows) differ
    whole = _loaded(_one_process(device, shards=1))
    assert not torch.equal(whole["state"]["5.weight"], one["state"]["5.weight"])
