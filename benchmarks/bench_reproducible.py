"""Cost of the reproducible mode: step time against the plan's default mode, at 1 and 2 CPU ranks.

The demo CNN (``DigitsCNN``, 32 channels) on 1,438 rows of 8x8 images, ``global_batch_size=64``,
one epoch per fit (22 steps); each variant is a fresh job, the variants alternate in ``ROUNDS``
rounds, and the median time between consecutive ``on_train_batch_end`` is compared:

* the default mode (the anchor): one process with torch's own threads, or 2 ranks of one thread
  each (Lightning's default when ranks share the machine);
* the default mode on 1 rank with one thread (the mode's own cost without the thread pinning);
* ``reproducible=True`` (8 virtual shards, one thread per rank; and 4 shards, which allow 4 ranks).

Memory: what a rank holds beyond the default mode at the peak of a step (its shards' gradients in
float32, one row widened to float64 and the sums, the BatchNorm updates), from the live tensors.

    .venv/bin/python benchmarks/bench_reproducible.py
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time

RESULT = "BENCH_RESULT "
ROUNDS = 3
VARIANTS = {  # name: (ranks, virtual shards (0: the default mode), threads of one process: None = torch's)
    "1 rank, default mode (anchor)": (1, 0, None),
    "1 rank, default mode, 1 thread": (1, 0, 1),
    "1 rank, reproducible": (1, 8, None),
    "2 ranks, default mode (anchor)": (2, 0, None),
    "2 ranks, reproducible": (2, 8, None),
    "2 ranks, reproducible, virtual_shards=4": (2, 4, None),
}


def worker(ranks: int, shards: int) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_plugins.app.demo import DigitsCNN
    from ddp_plugins.core import reproducible as core
    from ddp_plugins.lightning import DDPPluginsStrategy

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(1438, 1, 8, 8, generator=g), torch.randint(10, (1438,), generator=g))
    extra: list[int] = []
    finish = core.ShardedStep.finish

    def measured_finish(self, *args, **kwargs):  # the mode's tensors at the step's peak
        numel = sum(p.numel() for p in self.params)
        held = sum(row.nbytes for row in self._grads)  # this rank's shards' gradients, float32
        working = 8 * numel * 2  # one row widened to float64 at a time, and the sums
        extra.append(held + working + self._stats.updates.nbytes)
        return finish(self, *args, **kwargs)

    core.ShardedStep.finish = measured_finish
    ends: list[float] = []

    class Timer(pl.Callback):
        def on_train_batch_end(self, *args):
            ends.append(time.perf_counter())

    model = DigitsCNN(channels=32)
    model.train_dataloader = lambda: DataLoader(data, batch_size=32, shuffle=True)
    model.val_dataloader = lambda: []
    trainer = pl.Trainer(
        accelerator="cpu", devices=ranks, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=DDPPluginsStrategy(
            backend="gloo", global_batch_size=64, reproducible=shards > 0, virtual_shards=max(shards, 1)
        ),
        callbacks=[Timer()],
    )  # fmt: skip
    trainer.fit(model)
    if trainer.is_global_zero:
        steps = [b - a for a, b in zip(ends[3:], ends[4:], strict=False)]  # the first steps warm up
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        print(RESULT + json.dumps({"steps": steps, "extra": max(extra, default=0), "params": params}), flush=True)


def main() -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    memory: dict[str, tuple[int, int]] = {}
    for _ in range(ROUNDS):
        for name, (ranks, shards, threads) in VARIANTS.items():
            run_env = dict(env, OMP_NUM_THREADS=str(threads)) if threads else env
            cmd = [sys.executable, __file__, "--worker", str(ranks), str(shards)]
            out = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=600, check=False)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)), None)
            if line is None:
                raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
            result = json.loads(line[len(RESULT) :])
            times[name] += result["steps"]
            memory[name] = (result["extra"], result["params"])
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"\nDigitsCNN(channels=32), 64 rows per step, CPU (gloo), median of {len(times[name])} steps each\n")
    print("| variant | ms / step | ratio to the anchor | memory added |")
    print("|---|---:|---:|---:|")
    for name, ms in medians.items():
        anchor = medians[f"{VARIANTS[name][0]} rank{'s' * (VARIANTS[name][0] > 1)}, default mode (anchor)"]
        extra, params = memory[name]
        added = f"{extra / 2**20:.2f} MiB ({extra / params:.1f}x the parameters)" if extra else "-"
        print(f"| {name} | {ms:.2f} | {ms / anchor:.3f} | {added} |")
    spread = {name: statistics.quantiles(t, n=4) for name, t in times.items()}
    noisiest = max(spread, key=lambda n: (spread[n][2] - spread[n][0]) / statistics.median(times[n]))
    low, _, high = (q * 1e3 for q in spread[noisiest])
    print(f"\nnoise: the widest interquartile range is {noisiest!r}'s, {low:.2f}-{high:.2f} ms")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
