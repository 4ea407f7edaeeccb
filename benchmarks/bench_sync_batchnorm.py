"""Forward+backward time of a conv net with our SyncBatchNorm against plain BatchNorm, on 2 gloo ranks.

A 4-conv net with 4 ``BatchNorm2d`` layers, per-rank batches of 8 and 32 images of 3x32x32. The
anchor is the same net with plain (unsynchronized, local-statistics) ``BatchNorm2d``; ours is that
net after :func:`ddp_plugins.convert_sync_batchnorm`. Where CUDA and nccl exist (not on a CPU
machine) torch's ``nn.SyncBatchNorm`` is timed as a third column. No DDP wrapper: only the
normalization differs, so the ratio is the cost of synchronizing batch norm. The variants alternate
in rounds in one run (so load on the machine hits them alike); time is the median step. Collectives
are counted by wrapping ``torch.distributed``'s functions during one step.

    .venv/bin/python benchmarks/bench_sync_batchnorm.py
"""

from __future__ import annotations

import copy
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddp_plugins.distributed import exit_process, run_main  # noqa: E402
from ddp_plugins.sync_batchnorm import convert_sync_batchnorm  # noqa: E402

BATCHES = (8, 32)
ROUNDS = 5
STEPS_PER_ROUND = 6
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter")


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


def _count_collectives(net: nn.Module, x: torch.Tensor) -> int:
    counts = {"n": 0}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(fn):
        def wrapper(*args, **kwargs):
            counts["n"] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, counted(fn))
    try:
        _step(net, x)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counts["n"]


def _worker(rank: int, world_size: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
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
        per_layer = {name: _count_collectives(net, x) / layers for name, net in variants.items()}
        rows.append((batch, {name: statistics.median(t) for name, t in times.items()}, per_layer))
    if rank == 0:
        queue.put((rows, layers, str(device)))  # SimpleQueue: written before returning
    dist.barrier()
    exit_process(0)  # see ddp_plugins/distributed.py: no interpreter finalization with gloo threads alive


def main() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(2, port, queue), nprocs=2, start_method="spawn")
    rows, layers, device = queue.get()
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
