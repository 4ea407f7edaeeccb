"""What preemption safety costs: step time with the signal check on vs off, and SIGTERM to exit.

1. Step time on 2 CPU ranks (gloo) of the app's DigitsCNN with SyncBN: no ``PreemptionCheckpoint``
   (the anchor), the check on its default schedule (``"auto"``: about every half second), after
   every optimizer step, and after every 10th. The variants alternate in one run (A B C D A B C D
   ...) and the median time per step of each is compared. No checkpoint is written in these fits
   (no signal, no step checkpoints): only the agreement (an asynchronous ``all_reduce`` of two
   integers, read at the next step) is measured.
2. Time from ``SIGTERM`` sent to the whole process group of a running ``python -m ddp_plugins.train``
   job to its last process gone (every rank has stopped at one step, written the checkpoint and
   exited 143), against the job's own median step time, on the app's default schedule.

    .venv/bin/python benchmarks/bench_preemption.py
"""

import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from ddp_plugins.app.demo import DigitsCNN, SyntheticDataModule
from ddp_plugins.core import run_main
from ddp_plugins.lightning import DDPPluginsStrategy, PreemptionCheckpoint, SyncBatchNormCallback
from ddp_plugins.testing import LOOPBACK_ENV

REPEATS = 3
_ENV = {**os.environ, **LOOPBACK_ENV}  # before any fit: Lightning's launcher adds rank variables
STEPS = 40  # optimizer steps per fit; the first 5 are warm-up and not timed
STOPS = 3  # SIGTERM runs


class _StepClock(pl.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())


def _fit(check_every: int | str | None) -> list[float]:
    clock = _StepClock()
    callbacks: list[pl.Callback] = [SyncBatchNormCallback(), clock]
    if check_every is not None:
        callbacks.insert(1, PreemptionCheckpoint(check_every_n_steps=check_every))
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPPluginsStrategy(backend="gloo"), max_steps=STEPS,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tempfile.mkdtemp(),
    )  # fmt: skip
    data = SyntheticDataModule(num_samples=STEPS * 64 + 64, image_size=8, batch_size=32)
    trainer.fit(DigitsCNN(num_classes=10, channels=32), datamodule=data)
    ends = clock.ends[5:]
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]


def _stop_time() -> tuple[float, float, int]:
    """(seconds from SIGTERM to the last process gone, median step seconds of the job, exit code)."""
    run = Path(tempfile.mkdtemp()) / "run"
    cmd = [
        sys.executable, "-m", "ddp_plugins.train", "data=synthetic", "data.num_samples=20000",
        "trainer.enable_progress_bar=false", "trainer.max_epochs=1", "checkpoint.every_n_train_steps=10",
        "checkpoint.keep=100", "trainer.log_every_n_steps=1", f"hydra.run.dir={run}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=_ENV, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (run / "checkpoints" / "step-20.ckpt").exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the job ended early with exit code {proc.returncode}")
            time.sleep(0.05)
        sent = time.perf_counter()
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=120)
        while True:  # the rest of the group: the child rank, DataLoader workers
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
        gone = time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return gone, _median_job_step(run), code


def _median_job_step(run: Path) -> float:
    """The job's median step time, from the write times of its step checkpoints (10 steps apart)."""
    times = sorted(p.stat().st_mtime for p in (run / "checkpoints").glob("step-*.ckpt") if "preempted" not in p.name)
    gaps = [(b - a) / 10 for a, b in zip(times, times[1:], strict=False)]  # 10 steps between step checkpoints
    return statistics.median(gaps) if gaps else float("nan")


def main() -> None:
    os.environ.update(LOOPBACK_ENV)
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    variants: dict[str, int | str | None] = {
        "no PreemptionCheckpoint (anchor)": None,
        "auto: about every 0.5 s (default)": "auto",
        "check every step": 1,
        "check every 10 steps": 10,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(REPEATS):
        for name, every in variants.items():
            times[name] += _fit(every)
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    anchor = statistics.median(times["no PreemptionCheckpoint (anchor)"])
    print(
        "\nDigitsCNN (32 channels, SyncBN), batch 32/rank, 2 CPU ranks (gloo), "
        f"median of {len(times['check every step'])} steps per variant\n"
    )
    print("| variant | ms / step | ratio to anchor |")
    print("|---|---:|---:|")
    for name in variants:
        median = statistics.median(times[name])
        print(f"| {name} | {median * 1e3:.2f} | {median / anchor:.3f} |")

    stops = [_stop_time() for _ in range(STOPS)]
    print(f"\nSIGTERM to the process group of a running app job ({STOPS} runs):\n")
    print("| run | exit code | s from SIGTERM to last process gone | job step time (ms) | in steps |")
    print("|---|---:|---:|---:|---:|")
    for index, (gone, step, code) in enumerate(stops, 1):
        print(f"| {index} | {code} | {gone:.2f} | {step * 1e3:.1f} | {gone / step:.0f} |")


if __name__ == "__main__":
    run_main(main)
