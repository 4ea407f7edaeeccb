"""Communication hooks side by side: step time and bytes per step on 2 gloo CPU ranks.

``.venv/bin/python benchmarks/bench_comm_hooks.py``: trains the same ~4.2M-parameter MLP with DDP
(no hook, the anchor), ``fp16`` and ``powersgd`` (rank 4, compressing from step 2), built by
:func:`ddp_plugins.build_comm_hook`, in one run. Bytes are every ``torch.distributed.all_reduce``
tensor during the timed steps, counted in all threads (PowerSGD issues two of its three
all-reduces from future callbacks, which the per-hook ``CountingCommHook`` does not see); the anchor
uses torch's ``allreduce_hook``, the Python twin of DDP's built-in all-reduce, so it is counted too. Prints
ratios against the anchor and a markdown table for the README.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_plugins.distributed import exit_process  # noqa: E402
from ddp_plugins.strategy import build_comm_hook  # noqa: E402

HOOKS = ("none", "fp16", "powersgd")
WARMUP, STEPS, BATCH = 3, 12, 32
POWERSGD_RANK = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10))


class _Counter:
    """Counts the bytes of every ``dist.all_reduce`` while installed (all threads)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.lock = threading.Lock()
        self.original = dist.all_reduce

    def __enter__(self) -> _Counter:
        def counting(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            with self.lock:
                self.bytes += tensor.numel() * tensor.element_size()
            return self.original(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self.original


def _worker(rank: int, world_size: int, port: int, queue: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
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

        def step() -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(WARMUP):
            step()
        times = []
        with _Counter() as counter:
            for _ in range(STEPS):
                dist.barrier()
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
        results[name] = (statistics.median(times), counter.bytes / STEPS)
    results["numel"] = sum(p.numel() for p in _model().parameters())
    if rank == 0:
        queue.put(results)
    dist.barrier()
    exit_process(0)


def main() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, 2, port, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = queue.get(timeout=300)
    for proc in procs:
        proc.join(60)
    base_time, base_bytes = results["none"]
    print(f"model: {results['numel'] / 1e6:.2f}M parameters, 2 gloo CPU ranks, batch {BATCH} per rank,"
          f" median of {STEPS} steps")
    print("| hook | step time (ms) | time vs none | MB per step | bytes vs none |")
    print("|---|---|---|---|---|")
    for name in HOOKS:
        step_time, nbytes = results[name]
        label = f"powersgd (rank {POWERSGD_RANK})" if name == "powersgd" else name
        print(f"| {label} | {step_time * 1e3:.1f} | {step_time / base_time:.2f}x | {nbytes / 1e6:.2f} |"
              f" {nbytes / base_bytes:.3f}x |")


if __name__ == "__main__":
    main()
