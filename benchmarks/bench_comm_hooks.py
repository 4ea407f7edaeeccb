"""Communication hooks side by side: step time and bytes per step on 2 gloo CPU ranks.

``.venv/bin/python benchmarks/bench_comm_hooks.py``: trains the same ~4.2M-parameter MLP with DDP
(no hook, the anchor), ``fp16`` and ``powersgd`` (rank 4, compressing from step 2), built by
:func:`ddp_plugins.core.build_comm_hook`, in one run, on ranks started by
:func:`ddp_plugins.core.spawn`. Bytes are every ``torch.distributed.all_reduce`` tensor during the
timed steps, counted in all threads (PowerSGD's callbacks too) by the tests'
``count_collectives``; the anchor uses torch's ``allreduce_hook``, the Python twin of DDP's
built-in all-reduce, so it is counted too. Prints ratios against the anchor and a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_plugins.core import build_comm_hook, run_main
from ddp_plugins.testing import spawn
from tests.helpers.collectives import count_collectives

HOOKS = ("none", "fp16", "powersgd")
WARMUP, STEPS, BATCH = 3, 12, 32
POWERSGD_RANK = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _worker(rank: int, world_size: int) -> dict:
    """One rank (started by ``ddp_plugins.core.spawn``, process group ready): each hook's step time and bytes."""
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, 1024, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    results = {}
    for name in HOOKS:
        model = DistributedDataParallel(_model())
        state, hook = build_comm_hook(name, powersgd_rank=POWERSGD_RANK, powersgd_start_iter=2)
        if hook is None:  # DDP's built-in all-reduce runs in C++; torch's Python twin is countable
            state, hook = None, allreduce_hook
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(WARMUP):
            step()
        times = []
        with count_collectives(("all_reduce",)) as counts:  # every thread: PowerSGD's callbacks too
            for _ in range(STEPS):
                dist.barrier()
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
        results[name] = (statistics.median(times), counts.bytes["all_reduce"] / STEPS)
    results["numel"] = sum(p.numel() for p in _model().parameters())
    dist.barrier()
    return results


def main() -> None:
    results = spawn(_worker, world_size=2, timeout=300)[0]  # rank 0's figures
    base_time, base_bytes = results["none"]
    print(
        f"model: {results['numel'] / 1e6:.2f}M parameters, 2 gloo CPU ranks, batch {BATCH} per rank,"
        f" median of {STEPS} steps"
    )
    print("| hook | step time (ms) | time vs none | MB per step | bytes vs none |")
    print("|---|---|---|---|---|")
    for name in HOOKS:
        step_time, nbytes = results[name]
        label = f"powersgd (rank {POWERSGD_RANK})" if name == "powersgd" else name
        print(
            f"| {label} | {step_time * 1e3:.1f} | {step_time / base_time:.2f}x | {nbytes / 1e6:.2f} |"
            f" {nbytes / base_bytes:.3f}x |"
        )


if __name__ == "__main__":
    run_main(main)
