"""Benchmark: ``distributed_concat`` against torchmetrics' ``gather_all_tensors`` + ``torch.cat``, and a raw
``dist.all_gather`` + ``torch.cat`` of the same bytes (whose sizes are known in advance).

Two gloo ranks on 127.0.0.1, each holding ``N / 2`` rows x 10 classes of float32 (equal shards,
the only case the raw anchor supports), for N = 10^3, 10^4 and 10^6. All methods run in the same
processes, alternating call by call; time is the median over repeats, peak memory is the rise of the
process's resident set during one call (``VmHWM`` reset through ``/proc/self/clear_refs``, with
glibc told to map every large block afresh so that freed memory does not hide the peak).
A third row per size shows ``distributed_concat`` with uneven shards (rank 0 one row more),
which the raw anchor cannot do, and the last column counts the collective rounds of one call of each
(after the first call on the group, which agrees on the buffer size). The ranks are started by
:func:`ddp_plugins.core.spawn`.
Run: ``.venv/bin/python benchmarks/bench_evaluation.py``.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchmetrics.utilities.distributed import gather_all_tensors

from ddp_plugins.core import distributed_concat, run_main
from ddp_plugins.testing import spawn
from tests.helpers.collectives import count_collectives

SIZES = (1_000, 10_000, 1_000_000)
CLASSES = 10
REPEATS = {1_000: 150, 10_000: 100, 1_000_000: 15}
ROUNDS = (
    "all_gather",
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor",
    "all_gather_object",
)


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _raw(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def _torchmetrics(t: torch.Tensor) -> torch.Tensor:
    return torch.cat(gather_all_tensors(t))


def _ours(t: torch.Tensor) -> torch.Tensor:
    return distributed_concat(t, None)


def _peak_mb(fn, t: torch.Tensor) -> float:
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    before = _rss_kb("VmRSS")
    result = fn(t)
    peak = _rss_kb("VmHWM") - before
    del result
    return peak / 1024


def _seconds(fns: dict, t: dict, repeats: int) -> dict:
    """Median seconds per call of each function, calling them in turn so that load hits them alike."""
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn(t[name])
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _rounds(fn, t: torch.Tensor) -> int:
    with count_collectives(ROUNDS) as counts:
        fn(t)
    return sum(counts.calls.values())


def _worker(rank: int, world_size: int) -> list:
    """One rank (started by ``ddp_plugins.core.spawn``, gloo group ready): time and peak memory per size."""
    rows = []
    for n in SIZES:
        shard = torch.randn(n // world_size, CLASSES)
        uneven = torch.randn(n // world_size + (1 if rank == 0 else -1), CLASSES)
        expected = _raw(shard)
        assert torch.equal(_ours(shard), expected), "distributed_concat differs from the raw gather"
        assert torch.equal(_torchmetrics(shard), expected), "gather_all_tensors differs from the raw gather"
        fns = {"raw": _raw, "tm": _torchmetrics, "ours": _ours}
        for fn in fns.values():  # warm up every path
            fn(shard)
        rounds = {name: _rounds(fn, shard) for name, fn in fns.items()}
        mem = {name: _peak_mb(fn, shard) for name, fn in fns.items()} | {"uneven": _peak_mb(_ours, uneven)}
        sec = _seconds(fns | {"uneven": _ours}, dict.fromkeys(fns, shard) | {"uneven": uneven}, REPEATS[n])
        rows.append((n, sec, mem, rounds))
    dist.barrier()
    return rows


def main() -> None:
    # every large tensor a fresh mmap, returned at once when freed: the resident set then shows the true peak
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    rows = spawn(_worker, world_size=2, timeout=600)[0]  # rank 0's figures
    mb = lambda n: n * CLASSES * 4 / 2**20  # noqa: E731
    print(f"distributed_concat vs torchmetrics and raw all_gather + cat, 2 gloo ranks, float32 x {CLASSES} classes\n")
    print(
        "| samples | gathered | raw time | torchmetrics time | concat time | concat / torchmetrics | concat / raw |"
        " raw / torchmetrics / concat peak | concat uneven time / peak | rounds (raw / torchmetrics / concat) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, sec, mem, rounds in rows:
        print(
            f"| {n:.0e} | {mb(n):.1f} MB | {sec['raw'] * 1e3:.2f} ms | {sec['tm'] * 1e3:.2f} ms |"
            f" {sec['ours'] * 1e3:.2f} ms | {sec['ours'] / sec['tm']:.2f}x | {sec['ours'] / sec['raw']:.2f}x |"
            f" {mem['raw']:.1f} / {mem['tm']:.1f} / {mem['ours']:.1f} MB |"
            f" {sec['uneven'] * 1e3:.2f} ms / {mem['uneven']:.1f} MB |"
            f" {rounds['raw']} / {rounds['tm']} / {rounds['ours']} |"
        )
    print(
        "\nratio = distributed_concat's median time / the other's (lower is better); torchmetrics ="
        " gather_all_tensors + cat; peak = rise of the resident set during one call; rounds = collectives of one"
        " call (all_gather, all_gather_single, all_gather_object)"
    )


if __name__ == "__main__":
    run_main(main)
