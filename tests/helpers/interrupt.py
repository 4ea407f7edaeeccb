"""A test callback that interrupts a run at an exact point, once per run folder.

Added to the app on the command line (``+callbacks.interrupt._target_=tests.helpers.interrupt.SignalAt``
and its arguments). It sends a real signal, from inside the run, at a point a test could not hit
reliably from outside (during validation, while a checkpoint is being written). A marker file
makes it fire once per run folder, so the resumed run (same command) runs through.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from ddp_plugins.lightning import PreemptionCheckpoint

HOOKS = (
    "train_batch_end", "train_batch_start", "validation_batch_start", "save_checkpoint",
    "after_backward", "before_optimizer_step", "train_epoch_end", "validation_epoch_end",
)  # fmt: skip


class SignalAt(Callback):
    """Send ``sig`` at ``hook`` once ``global_step >= step``, from global rank ``rank``.

    Args:
        hook: one of :data:`HOOKS`.
        step: the first global step at which to fire.
        rank: the rank that sends.
        sig: the signal's name.
        target: ``"self"`` (this process), ``"group"`` (this process group: every rank and
            DataLoader worker, as a terminal's Ctrl-C or ``kill -- -PGID``) or ``"rank0"``.
        marker: file that records that the signal was sent (default: ``interrupted``); a relative
            path is in the run's root folder.
    """

    def __init__(self, hook: str, step: int = 0, rank: int = 0, sig: str = "SIGTERM", target: str = "self",
                 marker: str | None = None) -> None:  # fmt: skip
        assert hook in HOOKS, hook
        self.hook, self.step, self.rank, self.sig, self.target, self.marker = hook, step, rank, sig, target, marker

    def _maybe_fire(self, trainer: Any, hook: str) -> None:
        if hook != self.hook or trainer.global_rank != self.rank or trainer.global_step < self.step:
            return
        if hook.startswith("validation") and trainer.sanity_checking:
            return
        marker = Path(trainer.default_root_dir) / (self.marker or "interrupted")
        if marker.exists():
            return
        marker.write_text(f"{self.sig} at {hook}, step {trainer.global_step}\n")
        sig = getattr(signal, self.sig)
        if self.target == "group":
            os.killpg(os.getpgid(0), sig)
        elif self.target == "rank0":
            os.kill(os.getppid() if trainer.global_rank else os.getpid(), sig)
        else:
            os.kill(os.getpid(), sig)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._maybe_fire(trainer, "train_batch_end")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._maybe_fire(trainer, "train_batch_start")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._maybe_fire(trainer, "validation_batch_start")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._maybe_fire(trainer, "save_checkpoint")

    def on_after_backward(self, trainer, pl_module):
        self._maybe_fire(trainer, "after_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._maybe_fire(trainer, "before_optimizer_step")

    def on_train_epoch_end(self, trainer, pl_module):
        self._maybe_fire(trainer, "train_epoch_end")

    def on_validation_epoch_end(self, trainer, pl_module):
        self._maybe_fire(trainer, "validation_epoch_end")


class SlowStop(Callback):
    """Rank ``rank`` takes ``seconds`` longer to tear down after an exception (a loaded machine):
    signals that arrive while a stopped run tears down land in that window."""

    def __init__(self, seconds: float = 2.0, rank: int = 0) -> None:
        self.seconds, self.rank = seconds, rank

    def on_exception(self, trainer, pl_module, exception):
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


class AwaitSignal(Callback):
    """Every rank holds after optimizer step ``step`` until the app's PreemptionCheckpoint has received
    a signal sent from outside the run (``scancel --signal``), once per run folder. Rank 0 writes
    ``marker`` in the run's root folder when it starts to wait: the test sends the signal then. The
    signal so lands mid-training however fast the machine trains (a run that finished first made
    the Slurm requeue test fail by chance); ``timeout`` seconds without it fail the run."""

    def __init__(self, step: int = 3, marker: str = "awaiting-signal", timeout: float = 120.0) -> None:
        self.step, self.marker, self.timeout = step, marker, timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        (preemption,) = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
        marker = Path(trainer.default_root_dir) / self.marker
        waited_before = marker.exists()  # read on every rank before rank 0 writes it
        trainer.strategy.barrier("await-signal")
        if waited_before:
            return
        if trainer.is_global_zero:
            marker.write_text(f"waiting after step {trainer.global_step}\n")
        deadline = time.monotonic() + self.timeout
        while not preemption.signal_received:
            assert time.monotonic() < deadline, f"no signal within {self.timeout} s of {marker}"
            time.sleep(0.05)


class RaiseAt(Callback):
    """Raise ``ValueError("boom on rank R")`` at ``on_train_batch_end`` once ``global_step >= step``, on ``rank``."""

    def __init__(self, step: int = 0, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step and trainer.global_rank == self.rank:
            raise ValueError(f"boom on rank {trainer.global_rank}")


class WorkAt(Callback):
    """Rank ``rank`` works ``seconds`` (a sleep), once per run folder, ``where``: ``"epoch_end"``, at the end of
    training epoch ``epoch``, as a rank-zero-only callback does (sample generation, a metric over a large
    set); ``"first_step"``, before its first training step (a compile, a cold cache on one rank). The other
    ranks go on to the next collective and wait there."""

    def __init__(self, seconds: float = 330.0, rank: int = 0, epoch: int = 0, where: str = "epoch_end") -> None:
        assert where in ("epoch_end", "first_step"), where
        self.seconds, self.rank, self.epoch, self.where = seconds, rank, epoch, where

    def _work(self, trainer: Any, where: str) -> None:
        marker = Path(trainer.default_root_dir) / "worked"
        if where != self.where or trainer.global_rank != self.rank or marker.exists():
            return
        marker.write_text(f"{self.seconds} s at {where}\n")
        time.sleep(self.seconds)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            self._work(trainer, "epoch_end")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0:
            self._work(trainer, "first_step")
