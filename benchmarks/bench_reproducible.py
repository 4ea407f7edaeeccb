"""Cost of the reproducible mode: its step time against its own floor and the default mode, at 1 and 2 CPU ranks.

Three models: the demo CNN (``DigitsCNN``, 32 channels), an MLP of about 300k parameters and one of
about 3M, each at ``global_batch_size`` G = 40 and G = 256 with V = 8 virtual shards. Each variant is
a fresh job of 2 epochs on generated rows; the variants alternate over ``--rounds`` rounds, and the
median time between consecutive ``on_train_batch_end`` is compared with the default mode on the same
model, G and number of ranks (one thread per rank in both modes: the mode pins one, and 2 ranks
share this machine's 2 cores).

The floor: what sequential shards cost before any exact sum, the default mode's own code running each
rank's V / N shards of G / V rows as V / N accumulated micro-batches (``accumulate_grad_batches``, one
all-reduce per step), timed per optimizer step. The mode over its floor is what its exact sum, its
bookkeeping and its host syncs cost; the floor over the default mode is what shards of G / V rows cost.

Also printed: the bytes each rank all-reduces per step (the default mode: DDP's float32 gradients,
4 bytes a parameter; the mode: its two exchanges, counted), and the memory the mode keeps per rank
(the shards' float32 gradient block, the sum's float64 payload and scratch, the reduced gradients,
the BatchNorm updates).

    .venv/bin/python benchmarks/bench_reproducible.py [--rounds 3] [--quick] [--ranks 1 2] [--models cnn ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time

RESULT = "BENCH_RESULT "
MODELS = ("cnn", "mlp-300k", "mlp-3M")
BATCHES = (40, 256)
RANKS = (1, 2)
SHARDS = 8  # V, the mode's default virtual_shards
MODES = ("default", "floor", "reproducible")


def _model(kind: str):
    import torch
    from torch import nn

    from ddp_plugins.app.demo import DigitsCNN

    if kind == "cnn":
        return DigitsCNN(channels=32), (1, 8, 8)
    width = 512 if kind == "mlp-300k" else 1700

    class MLP(DigitsCNN):  # the demo's training and validation steps, another network
        def __init__(self) -> None:
            super().__init__(channels=4)
            self.features = nn.Sequential(
                nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()
            )
            self.head = nn.Linear(width, 10)

    torch.manual_seed(0)
    return MLP(), (1, 8, 8)


def worker(kind: str, batch: int, ranks: int, mode: str) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_plugins.core import reproducible as core
    from ddp_plugins.lightning import DDPPluginsStrategy

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    model, shape = _model(kind)
    g = torch.Generator().manual_seed(0)
    rows = 40 * batch // 4  # 10 steps per epoch
    data = TensorDataset(torch.randn(rows, *shape, generator=g), torch.randint(10, (rows,), generator=g))
    sent: list[int] = []
    extra: list[int] = []
    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):  # the mode's own exchanges (DDP's reducer runs in C++)
        sent.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, **kwargs)

    core.dist.all_reduce = counted  # a benchmark's own probe: the package never patches torch
    finish = core.ShardedStep.finish

    def measured_finish(self, *args, **kwargs):
        updates = self._stats.updates.nbytes
        out = finish(self, *args, **kwargs)
        if hasattr(self, "_block"):  # (an earlier version of the mode, measured side by side, has none)
            kept = [self._block, *self._work.values(), *self._out]  # the gradient block, the sum's buffers
            extra.append(sum(t.nbytes for t in kept) + updates)
        return out

    core.ShardedStep.finish = measured_finish
    ends: list[float] = []

    class Timer(pl.Callback):  # at each optimizer step's end (the floor accumulates V / N micro-batches)
        def on_train_batch_end(self, trainer, *args):
            if len(ends) < trainer.global_step:
                ends.append(time.perf_counter())

    reproducible, accumulate = mode == "reproducible", SHARDS // ranks if mode == "floor" else 1
    model.train_dataloader = lambda: DataLoader(data, batch_size=max(1, batch // ranks), shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=ranks, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=DDPPluginsStrategy(backend="gloo", global_batch_size=batch, reproducible=reproducible),
        callbacks=[Timer()], accumulate_grad_batches=accumulate,
    )  # fmt: skip
    sent.clear()
    trainer.fit(model)
    if trainer.is_global_zero:
        steps = [b - a for a, b in zip(ends[3:], ends[4:], strict=False)]  # the first steps warm up
        params = sum(p.numel() for p in model.parameters())
        per_step = sum(sent) / max(1, len(ends)) if reproducible else 4 * params
        print(RESULT + json.dumps({"steps": steps, "extra": max(extra, default=0), "params": params,
                                   "bytes": per_step}), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the 300k MLP at G = 40 only")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--ranks", nargs="+", type=int, choices=RANKS, default=list(RANKS))
    args = parser.parse_args()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    models, batches = (("mlp-300k",), (40,)) if args.quick else (tuple(args.models), BATCHES)
    variants = [(m, b, n, mode) for m in models for b in batches for n in args.ranks for mode in MODES]
    times: dict[tuple, list[float]] = {v: [] for v in variants}
    info: dict[tuple, dict] = {}
    for _ in range(args.rounds):
        for variant in variants:
            cmd = [sys.executable, __file__, "--worker", *(str(x) for x in variant)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)), None)
            if line is None:
                raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
            result = json.loads(line[len(RESULT) :])
            times[variant] += result["steps"]
            info[variant] = result
    print(f"\nCPU, gloo, one thread per rank, V = {SHARDS}; medians over", args.rounds, "interleaved rounds\n")
    print("| model (parameters) | G | ranks | default ms/step | floor ms/step | reproducible ms/step | mode / floor"
          " | mode / default | all-reduced per step (default -> mode) | memory added per rank |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for m in models:
        for b in batches:
            for n in args.ranks:
                base, floor, mode = (statistics.median(times[(m, b, n, x)]) for x in MODES)
                d, r = info[(m, b, n, "default")], info[(m, b, n, "reproducible")]
                memory = f"{r['extra'] / 2**20:.1f} MiB ({r['extra'] / (4 * r['params']):.1f}x the parameters)"
                print(f"| {m} ({d['params'] / 1e3:.0f}k) | {b} | {n} | {base * 1e3:.2f} | {floor * 1e3:.2f} |"
                      f" {mode * 1e3:.2f} | {mode / floor:.2f}x | {mode / base:.2f}x | {d['bytes'] / 2**20:.2f} ->"
                      f" {r['bytes'] / 2**20:.2f} MiB ({r['bytes'] / d['bytes']:.2f}x) | {memory} |")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
