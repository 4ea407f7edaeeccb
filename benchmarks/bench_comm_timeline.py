"""What the pack and CommTimeline cost per step, against plain Lightning DDP.

Step time on 2 CPU ranks (gloo) of the app's DigitsCNN (plain BatchNorm: SyncBN changes the math
and has its own benchmark) in four variants that alternate in one run, each round starting at the
next variant (A B C D, B C D A, C D A B, ...), so that no variant always runs in the same slot:

1. plain Lightning: ``DDPStrategy(process_group_backend="gloo")``, no callbacks (the anchor);
2. the same again: the ratio of two identical fits shows this machine's noise;
3. the pack: ``DDPPluginsStrategy`` with ``AccumulationNoSync``, ``AllReduceCounter``,
   ``RankAwareSeed`` and ``PreemptionCheckpoint`` (its stop check on the default schedule, about
   every half second);
4. that with ``CommTimeline`` (DDP's buckets and buffer broadcast and the pack's own collectives
   timed, the records gathered every 50 steps, the trace written at the end of fit).

Each fit's time is the median over its steps (after 5 warm-up steps) of the time between two ends
of a training batch on rank 0 (DDP keeps the ranks in step). The variants alternate ``REPEATS`` times;
a ratio is taken within each round (against the anchor fitted just before it) and the table gives
the median of those ratios with their interquartile range, since this machine's speed drifts
between rounds by more than the differences measured. A second table does the same with rank 0's
CPU time per step (``time.process_time``: every thread of the process): what the pack's own code
costs, less sensitive than wall time to the other processes sharing the machine's cores.

    .venv/bin/python benchmarks/bench_comm_timeline.py
    .venv/bin/python benchmarks/bench_comm_timeline.py --pieces  # each piece of the pack alone, 12 rounds
    python benchmarks/bench_comm_timeline.py --gpu  # 1 rank on nccl on one GPU, 6 rounds (make gpu-check)
"""

import logging
import os
import statistics
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from ddp_plugins.app.demo import DigitsCNN, SyntheticDataModule
from ddp_plugins.core import run_main
from ddp_plugins.lightning import (
    AccumulationNoSync,
    AllReduceCounter,
    CommTimeline,
    DDPPluginsStrategy,
    PreemptionCheckpoint,
    RankAwareSeed,
)
from ddp_plugins.testing import LOOPBACK_ENV

REPEATS = 12
STEPS = 60  # optimizer steps per fit; the first 5 are warm-up and not timed
VARIANTS = (
    "plain Lightning DDP (anchor)",
    "plain Lightning DDP again (noise)",
    "ddp_plugins: strategy + callbacks",
    "the line above + CommTimeline",
)
# --pieces: the pack's cost split by piece, each added alone to the strategy (12 rounds: two rotations)
PIECES = (
    "plain Lightning DDP (anchor)",
    "DDPPluginsStrategy alone",
    "strategy + AllReduceCounter",
    "strategy + PreemptionCheckpoint",
    "strategy + AccumulationNoSync + RankAwareSeed",
    "plain Lightning DDP + 4 callbacks that do nothing",
)


class _StepClock(pl.Callback):
    """Wall time and this process's CPU time (every thread: gloo's, DDP's reducer) at each batch end."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append((time.perf_counter(), time.process_time()))


GPU = "--gpu" in sys.argv[1:]
BACKEND = "nccl" if GPU else "gloo"


def _fit(variant: str) -> tuple[float, float]:
    """Median wall and CPU seconds per step of one fit of ``variant``."""
    clock = _StepClock()
    root = tempfile.mkdtemp()
    callbacks: list[pl.Callback] = [clock]
    strategy: DDPStrategy = DDPStrategy(process_group_backend=BACKEND)
    if variant in VARIANTS[2:]:
        strategy = DDPPluginsStrategy(backend=BACKEND)
        callbacks += [AccumulationNoSync(1), AllReduceCounter(), RankAwareSeed(seed=0), PreemptionCheckpoint()]
    if variant == VARIANTS[3]:
        callbacks.append(CommTimeline(every_n_steps=50, trace_path=f"{root}/trace.json"))
    if variant == PIECES[5]:  # what Lightning's dispatch of every hook to a callback costs by itself
        callbacks += [pl.Callback() for _ in range(4)]
    elif variant in PIECES[1:]:
        strategy = DDPPluginsStrategy(backend=BACKEND)
        callbacks += {
            PIECES[2]: [AllReduceCounter()],
            PIECES[3]: [PreemptionCheckpoint()],
            PIECES[4]: [AccumulationNoSync(1), RankAwareSeed(seed=0)],
        }.get(variant, [])
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cuda" if GPU else "cpu", devices=1 if GPU else 2,
        strategy=strategy, max_steps=STEPS, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=root,
    )  # fmt: skip
    data = SyntheticDataModule(num_samples=STEPS * 64 + 64, image_size=8, batch_size=32)
    trainer.fit(DigitsCNN(num_classes=10, channels=32), datamodule=data)
    ends = clock.ends[5:]
    steps = list(zip(ends, ends[1:], strict=False))
    return statistics.median(b[0] - a[0] for a, b in steps), statistics.median(b[1] - a[1] for a, b in steps)


def main() -> None:
    os.environ.update(LOOPBACK_ENV)
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    variants, repeats = (PIECES, 12) if "--pieces" in sys.argv[1:] else (VARIANTS, 6 if GPU else REPEATS)
    rounds: list[dict[str, tuple[float, float]]] = []
    for index in range(repeats):
        # each round starts at another variant: no variant always runs first or after the same one
        shift = index % len(variants)
        rounds.append({name: _fit(name) for name in variants[shift:] + variants[:shift]})
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    where = f"1 rank on {torch.cuda.get_device_name()} (nccl)" if GPU else "2 CPU ranks (gloo)"
    print(
        f"\nDigitsCNN (32 channels, plain BN), batch 32/rank, {where}, {repeats} rounds of {STEPS} steps per variant\n"
    )
    for index, what in enumerate(("wall", "CPU (rank 0, every thread)")):
        print(f"\n{what} time per step\n")
        header = "| variant | ms / step (median of rounds) | ratio to plain Lightning | quartiles |"
        print(header + " ratio to the line above |")
        print("|---|---:|---:|---:|---:|")
        previous = variants[0]
        for name in variants:
            ms = statistics.median(r[name][index] for r in rounds) * 1e3
            ratios = [r[name][index] / r[variants[0]][index] for r in rounds]
            low, mid, high = statistics.quantiles(ratios, n=4)
            step = statistics.median(r[name][index] / r[previous][index] for r in rounds)
            print(f"| {name} | {ms:.2f} | {mid:.3f} | {low:.3f}-{high:.3f} | {step:.3f} |")
            previous = name


if __name__ == "__main__":
    run_main(main)
