"""Forward+backward time of a conv net with our SyncBatchNorm against plain BatchNorm, on 2 gloo ranks.

A 4-conv net with 4 ``BatchNorm2d`` layers, per-rank batches of 8 and 32 images of 3x32x32. The
anchor is the same net with plain (unsynchronized, local-statistics) ``BatchNorm2d``; ours is that
net after :func:`ddp_plugins.core.convert_sync_batchnorm`. Where CUDA and nccl exist (not on a CPU
machine) torch's ``nn.SyncBatchNorm`` is timed as a third column. No DDP wrapper: only the
normalization differs, so the difference is the cost of synchronizing batch norm.

The floor is the same number of bare all_reduces (one forward, one backward per layer), timed alone:
the latency any synchronized BN pays. A second reference, plain BN with those all_reduces inserted
at the same points (no other change), shows what merely synchronizing the ranks at each layer costs
inside a step on this machine: there, the rank that arrives first waits for the other.

Fair to every variant: each rank runs with ``THREADS`` intra-op thread(s) (set here, as
:func:`ddp_plugins.testing.spawn` also sets ``OMP_NUM_THREADS=1``), every step starts after a
barrier, and a step's time is that of the slower rank (what a DDP step waits for; unsynchronized
plain BN would otherwise be timed on one rank only). The variants alternate in rounds in one run
(so load on the machine hits them alike); time is the median step. Collectives are counted with
``count_collectives`` (tests/helpers/collectives.py) during one step.

    .venv/bin/python benchmarks/bench_sync_batchnorm.py
    python benchmarks/bench_sync_batchnorm.py --share-gpu  # both ranks on cuda:0 over gloo (make gpu-check)

With ``--share-gpu`` the two ranks share one GPU over gloo (which takes CUDA tensors; nccl needs a GPU
per rank), torch's ``nn.SyncBatchNorm`` (its CUDA kernels) runs on the same gloo group, each round
starts at another variant, and "plain BN again" shows the noise (its ratio to plain BN).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddp_plugins.core import convert_sync_batchnorm, run_main
from ddp_plugins.testing import spawn
from tests.helpers.collectives import count_collectives

BATCHES = (8, 32)
ROUNDS = 6
STEPS_PER_ROUND = 6
THREADS = 1  # intra-op threads per rank: 2 ranks on a 2-core machine


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1, stride=2), nn.BatchNorm2d(128), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    )  # fmt: skip


class _SyncPoint(torch.autograd.Function):
    """Identity that all-reduces a payload of our size: forward ``2C+1`` float64, backward ``2C``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(torch.zeros(2 * x.size(1) + 1, dtype=torch.float64))
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(torch.zeros(2 * grad.size(1), dtype=grad.dtype))
        return grad


class _PlainWithSyncPoints(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SyncPoint.apply(self.layer(x))


def _with_sync_points(net: nn.Module) -> nn.Module:
    net = copy.deepcopy(net)
    for i, layer in enumerate(net):
        if isinstance(layer, nn.BatchNorm2d):
            net[i] = _PlainWithSyncPoints(layer)
    return net


def _step(net: nn.Module, x: torch.Tensor) -> float:
    dist.barrier()
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
    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        dist.all_reduce(payload)
    return time.perf_counter() - start


def _collectives_per_step(net: nn.Module, x: torch.Tensor) -> int:
    with count_collectives() as counts:  # all_reduce, all_gather(_into_tensor), broadcast, reduce_scatter
        net(x).square().mean().backward()
    for p in net.parameters():
        p.grad = None
    return sum(counts.calls.values())


def _slower_rank(times: dict[str, list[float]]) -> dict[str, float]:
    """Per variant, the median over steps of the slower rank's time (every rank ran the same steps)."""
    names = list(times)
    table = torch.tensor([times[name] for name in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return {name: statistics.median(row) for name, row in zip(names, table.tolist(), strict=True)}


def _worker(rank: int, world_size: int, share_gpu: bool = False) -> tuple:
    """One rank (started by ``ddp_plugins.core.spawn``, gloo group ready): the timings of every variant."""
    torch.set_num_threads(THREADS)
    cuda = torch.cuda.device_count() >= world_size and dist.is_nccl_available()  # torch's SyncBN: a GPU per rank
    device = torch.device("cuda", 0 if share_gpu else rank) if cuda or share_gpu else torch.device("cpu")
    base = _net().to(device)
    variants = {"plain": base, "ours": convert_sync_batchnorm(copy.deepcopy(base))}
    if share_gpu:
        variants["plain again"] = copy.deepcopy(base)
        variants["torch"] = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base))  # the gloo group
    elif cuda:
        group = dist.new_group(backend="nccl")
        variants["torch"] = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base), group)
    else:  # gloo all_reduces of CPU tensors
        variants["synced plain"] = _with_sync_points(base)
    layers = sum(isinstance(m, nn.BatchNorm2d) for m in base.modules())
    rows = []
    for batch in BATCHES:
        x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(rank)).to(device)
        times: dict[str, list[float]] = {name: [] for name in variants}
        times["floor"] = []
        for net in variants.values():  # warm up
            for _ in range(2):
                _step(net, x)
        names = list(variants)
        for index in range(ROUNDS):
            shift = index % len(names)  # each round starts at another variant
            for name in names[shift:] + names[:shift]:
                times[name] += [_step(variants[name], x) for _ in range(STEPS_PER_ROUND)]
            times["floor"] += [_bare_all_reduces(2 * layers) for _ in range(STEPS_PER_ROUND)]
        per_layer = {name: _collectives_per_step(net, x) / layers for name, net in variants.items()}
        rows.append((batch, _slower_rank(times), per_layer))
    return rows, layers, str(device), torch.get_num_threads()


def main() -> None:
    share_gpu = "--share-gpu" in sys.argv[1:]
    if share_gpu and not torch.cuda.is_available():
        raise SystemExit("--share-gpu needs a CUDA GPU")
    rows, layers, device, threads = spawn(_worker, share_gpu, world_size=2, timeout=900, pg_timeout=120)[0]
    has_torch = "torch" in rows[0][1]
    has_synced = "synced plain" in rows[0][1]
    print(
        f"SyncBatchNorm forward+backward, conv net with {layers} BatchNorm2d layers, 2 ranks (gloo), {device},"
        f" {threads} intra-op thread(s) per rank, input 3x32x32 per image, median step time of the slower rank\n"
    )
    header = (
        "| batch per rank | plain BN | ddp_plugins SyncBN | ours / plain | extra (ours - plain)"
        " | floor: the same all_reduces alone | extra / floor |"
    )
    if has_synced:
        header += " plain BN + the same all_reduces | in-step floor (that - plain) | extra / in-step floor |"
    if has_torch:
        header += " torch SyncBN | ratio (ours / torch) |"
    has_noise = "plain again" in rows[0][1]
    if has_noise:
        header += " noise (plain again / plain) |"
    header += " collectives per layer per step (ours) |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for batch, sec, per_layer in rows:
        extra = sec["ours"] - sec["plain"]
        line = (
            f"| {batch} | {sec['plain'] * 1e3:.1f} ms | {sec['ours'] * 1e3:.1f} ms | {sec['ours'] / sec['plain']:.2f}x"
            f" | {extra * 1e3:.1f} ms | {sec['floor'] * 1e3:.1f} ms | {extra / sec['floor']:.2f}x |"
        )
        if has_synced:
            in_step = sec["synced plain"] - sec["plain"]
            line += f" {sec['synced plain'] * 1e3:.1f} ms | {in_step * 1e3:.1f} ms | {extra / in_step:.2f}x |"
        if has_torch:
            line += f" {sec['torch'] * 1e3:.1f} ms | {sec['ours'] / sec['torch']:.2f}x |"
        if has_noise:
            line += f" {sec['plain again'] / sec['plain']:.2f}x |"
        line += f" {per_layer['ours']:g} (plain: {per_layer['plain']:g}) |"
        print(line)
    print(
        "\nextra / floor: the cost of synchronizing (one fused all_reduce forward, one backward, per layer) over"
        f" the latency of {2 * layers} bare all_reduces; in-step floor: those all_reduces at the same points of a"
        " plain-BN step (what synchronizing alone costs there, the waits for the other rank at each layer included)"
    )


if __name__ == "__main__":
    run_main(main)
