"""What the pack and CommTimeline cost per step, against plain Lightning DDP.

Step time on 2 CPU ranks (gloo) of the app's DigitsCNN (plain BatchNorm: SyncBN changes the math
and has its own benchmark) in three variants that alternate in one run (A B C A B C ...):

1. plain Lightning: ``DDPStrategy(process_group_backend="gloo")``, no callbacks (the anchor);
2. the pack: ``DDPPluginsStrategy`` with ``AccumulationNoSync``, ``AllReduceCounter``,
   ``RankAwareSeed`` and ``PreemptionCheckpoint`` (its one-integer agreement every step, the default);
3. the same with the stop check every 10 steps (``check_every_n_steps=10``);
4. that with ``CommTimeline`` (every collective timed, the records gathered every 50 steps, the
   trace written at the end of fit).

Each variant's time is the median over its steps (after 5 warm-up steps per fit) of the time
between two ends of a training batch on rank 0 (DDP keeps the ranks in step).

    .venv/bin/python benchmarks/bench_comm_timeline.py
"""

import logging
import os
import statistics
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

REPEATS = 3
STEPS = 60  # optimizer steps per fit; the first 5 are warm-up and not timed
VARIANTS = (
    "plain Lightning DDP (anchor)",
    "ddp_plugins: strategy + callbacks (stop check every step)",
    "ddp_plugins, stop check every 10 steps",
    "the line above + CommTimeline",
)


class _StepClock(pl.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())


def _fit(variant: str) -> list[float]:
    clock = _StepClock()
    root = tempfile.mkdtemp()
    callbacks: list[pl.Callback] = [clock]
    strategy: DDPStrategy = DDPStrategy(process_group_backend="gloo")
    if variant != VARIANTS[0]:
        strategy = DDPPluginsStrategy(backend="gloo")
        check_every = 1 if variant == VARIANTS[1] else 10
        callbacks += [AccumulationNoSync(1), AllReduceCounter(), RankAwareSeed(seed=0)]
        callbacks.append(PreemptionCheckpoint(check_every_n_steps=check_every))
    if variant == VARIANTS[3]:
        callbacks.append(CommTimeline(every_n_steps=50, trace_path=f"{root}/trace.json"))
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=root,
    )  # fmt: skip
    data = SyntheticDataModule(num_samples=STEPS * 64 + 64, image_size=8, batch_size=32)
    trainer.fit(DigitsCNN(num_classes=10, channels=32), datamodule=data)
    ends = clock.ends[5:]
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]


def main() -> None:
    os.environ.update(LOOPBACK_ENV)
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(REPEATS):
        for name in VARIANTS:
            times[name] += _fit(name)
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        "\nDigitsCNN (32 channels, plain BN), batch 32/rank, 2 CPU ranks (gloo), "
        f"median of {len(times[VARIANTS[0]])} steps per variant\n"
    )
    print("| variant | ms / step | ratio to plain Lightning | ratio to the line above |")
    print("|---|---:|---:|---:|")
    previous = median[VARIANTS[0]]
    for name in VARIANTS:
        ratio = median[name] / median[VARIANTS[0]]
        print(f"| {name} | {median[name] * 1e3:.2f} | {ratio:.3f} | {median[name] / previous:.3f} |")
        previous = median[name]


if __name__ == "__main__":
    run_main(main)
