"""Forward+backward time of a conv net with our SyncBatchNorm against plain BatchNorm, on 2 gloo ranks.

A 4-conv net with 4 ``BatchNorm2d`` layers, per-rank batches of 8 and 32 images of 3x32x32. The
anchor is the same net with plain (unsynchronized, local-statistics) ``BatchNorm2d``; ours is that
net after :func:`ddp_plugins.core.convert_sync_batchnorm`. Where CUDA and nccl exist (not on a CPU
machine) torch's ``nn.SyncBatchNorm`` is timed as a third column. No DDP wrapper: only the
normalization differs, so the ratio is the cost of synchronizing batch norm. The variants alternate
in rounds in one run (so load on the machine hits them alike); time is the median step. Collectives
are counted with :func:`ddp_plugins.core.count_collectives` during one step; the ranks are started
by :func:`ddp_plugins.core.spawn`.

    .venv/bin/python benchmarks/bench_sync_batchnorm.py
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddp_plugins.core import convert_sync_batchnorm, count_collectives, run_main
from ddp_plugins.testing import spawn

BATCHES = (8, 32)
ROUNDS = 5
STEPS_PER_ROUND = 6


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1, stride=2), nn.BatchNorm2d(128), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    )  # fmt: skip


def _step(net: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    net(x).square().mean().backward()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    elapsed = time.perf_counter() - start
    for p in net.parameters():
        p.grad = None
    return elapsed


def _bare_all_reduces(count: int) -> float:
    """The time of ``count`` tiny all_reduces alone: the latency floor of synchronizing."""
    payload = torch.zeros(257, dtype=torch.float64)
    start = time.perf_counter()
    for _ in range(count):
        dist.all_reduce(payload)
    return time.perf_counter() - start


def _collectives_per_step(net: nn.Module, x: torch.Tensor) -> int:
    with count_collectives() as counts:  # all_reduce, all_gather(_into_tensor), broadcast, reduce_scatter
        _step(net, x)
    return sum(counts.calls.values())


def _worker(rank: int, world_size: int) -> tuple:
    """One rank (started by ``ddp_plugins.core.spawn``, gloo group ready): the timings of every variant."""
    cuda = torch.cuda.device_count() >= world_size and dist.is_nccl_available()  # torch's SyncBN: a GPU per rank
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    base = _net().to(device)
    variants = {"plain": base, "ours": convert_sync_batchnorm(copy.deepcopy(base))}
    if cuda:
        group = dist.new_group(backend="nccl")
        variants["torch"] = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base), group)
    layers = sum(isinstance(m, nn.BatchNorm2d) for m in base.modules())
    rows = []
    for batch in BATCHES:
        x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(rank)).to(device)
        times: dict[str, list[float]] = {name: [] for name in variants}
        times["latency"] = []
        for net in variants.values():  # warm up
            for _ in range(2):
                _step(net, x)
        for _ in range(ROUNDS):
            for name, net in variants.items():
                dist.barrier()
                times[name] += [_step(net, x) for _ in range(STEPS_PER_ROUND)]
            dist.barrier()
            times["latency"] += [_bare_all_reduces(2 * layers) for _ in range(STEPS_PER_ROUND)]
        per_layer = {name: _collectives_per_step(net, x) / layers for name, net in variants.items()}
        rows.append((batch, {name: statistics.median(t) for name, t in times.items()}, per_layer))
    dist.barrier()
    return rows, layers, str(device)


def main() -> None:
    rows, layers, device = spawn(_worker, world_size=2, timeout=600, pg_timeout=120)[0]  # rank 0's figures
    has_torch = "torch" in rows[0][1]
    print(
        f"SyncBatchNorm forward+backward, conv net with {layers} BatchNorm2d layers, 2 ranks (gloo), {device},"
        " input 3x32x32 per image, median step time\n"
    )
    header = "| batch per rank | plain BN | ddp_plugins SyncBN | ratio (ours / plain) |"
    if has_torch:
        header += " torch SyncBN | ratio (ours / torch) |"
    header += " collectives per layer per step (ours) | the same all_reduces alone |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for batch, sec, per_layer in rows:
        ratio = sec["ours"] / sec["plain"]
        line = f"| {batch} | {sec['plain'] * 1e3:.1f} ms | {sec['ours'] * 1e3:.1f} ms | {ratio:.2f}x |"
        if has_torch:
            line += f" {sec['torch'] * 1e3:.1f} ms | {sec['ours'] / sec['torch']:.2f}x |"
        line += f" {per_layer['ours']:g} (plain: {per_layer['plain']:g}) | {sec['latency'] * 1e3:.1f} ms |"
        print(line)
    print(
        "\nours / plain: the cost of synchronizing (one fused all_reduce forward, one backward, per layer);"
        f" the last column times {2 * layers} bare all_reduces, the latency floor of any synchronized BN"
    )


if __name__ == "__main__":
    run_main(main)
