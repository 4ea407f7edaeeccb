"""Preemption-safe training: stop anywhere, resume, end bit-identical; see docs/design.md, "Preemption"."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from typing_extensions import override

from ddp_plugins.core.checkpoints import PER_RANK, remove_checkpoint_file, write_order
from ddp_plugins.core.checks import check_choice, check_int
from ddp_plugins.core.files import count_csv_rows, read_json, truncate_csv_rows, write_text_atomic
from ddp_plugins.core.preemption import (
    DEFAULT_SIGNALS,
    Preempted,
    SignalAgreement,
    SignalFlag,
    check_signals,
    slurm_job_id,
    slurm_requeue,
    submitit_signal,
)
from ddp_plugins.lightning.accumulation import is_step_boundary
from ddp_plugins.lightning.contracts import SavesCheckpoints, StepAgreement, implements
from ddp_plugins.lightning.epoch_partials import EpochPartials

__all__ = ["PreemptionCheckpoint"]

log = logging.getLogger(__name__)

ROWS_LEDGER = "metrics_rows.json"
_STEP_FILE = re.compile(r"^step-(\d+)(-preempted|-stalled)?\.ckpt$")  # the liveness rescue too


class PreemptionCheckpoint(Callback):
    """On a signal, stop every rank at one step, checkpoint, exit ``128 + signal``; step checkpoints with epoch sums.

    Lightning's own handlers checkpoint or broadcast inside the handler, which hangs a DDP job mid-collective.

    Args:
        dirpath: folder of the checkpoints (default: ``<default_root_dir>/checkpoints``).
        every_n_train_steps: also write a checkpoint every this many optimizer steps (0: only on a signal).
        keep: how many of this callback's step checkpoints to keep (the newest), at least 1.
        signals: the signals that stop the run; a second Ctrl-C ends the process at once.
        check_every_n_steps: agree on the flag every this many optimizer steps, or ``"auto"`` (about every 0.5 s).
        requeue: ``"auto"`` (Slurm: after ``requeue_signal`` or submitit's ``SIGUSR2``), ``"always"`` or ``"never"``.
        requeue_signal: the signal Slurm sends before preempting (``--signal=USR1@90``).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[PreemptionCheckpoint(every_n_train_steps=50)], logger=False)
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int = 0,
        keep: int = 2,
        signals: list[str] | tuple[str, ...] = DEFAULT_SIGNALS,
        check_every_n_steps: int | str = "auto",
        requeue: str = "auto",
        requeue_signal: str = "SIGUSR1",
    ) -> None:
        self.dirpath = dirpath
        self.every_n_train_steps = check_int("every_n_train_steps", every_n_train_steps, 0)
        self.keep = check_int("keep", keep, 1)
        self.signals = check_signals(signals)
        self.check_every_n_steps = check_int("check_every_n_steps", check_every_n_steps, 1, allowed_words=("auto",))
        self.requeue = check_choice("requeue", requeue, ("auto", "always", "never"))
        (self.requeue_signal,) = check_signals([requeue_signal])
        self._flag = SignalFlag(self.signals)
        self._agreement = SignalAgreement()
        self._rows_pending = False  # a checkpoint was written; its metrics rows are counted at the next hook
        self._trainer: pl.Trainer | None = None
        # the files written since the rows were last counted (every callback's, where the strategy records them)
        self._pending_paths: list[str] = []
        self._counted = 0  # the strategy's checkpoint_paths already counted
        self._stop: Preempted | None = None
        self._due: tuple[int, bool] | None = None  # (signal, step checkpoint) due at the epoch's end
        self._partials = EpochPartials()  # the interrupted epoch's running sums, added back after a resume
        self.resumed_from: str | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.dirpath is None:
            self.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
        self._trainer, self._rows_pending, self._stop, self._due = trainer, False, None, None
        self._pending_paths = []
        self._counted = len(trainer.strategy.checkpoint_paths) if implements(trainer.strategy, SavesCheckpoints) else 0
        self._flag.clear()
        self._agreement = SignalAgreement(every=self.check_every_n_steps)
        if implements(trainer.strategy, StepAgreement):
            trainer.strategy.add_flag_source(self._signum)
        submitit = submitit_signal()
        self._requeue_signals = {self.requeue_signal} | ({submitit} if submitit else set())
        if submitit and submitit not in self._flag.signals:
            self._flag = SignalFlag((*self.signals, submitit))
        # handlers installed at sanity check / train start: Lightning registers its own after on_fit_start

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flag.install()  # replaces Lightning's handlers, registered just before

    on_train_start = on_sanity_check_start

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._agreement.cancel()
            self._flag.restore()
            self._trainer = None
            if implements(trainer.strategy, StepAgreement):
                trainer.strategy.remove_flag_source(self._signum)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, Preempted):
            # ours stay until teardown: requeue signals reach ranks tearing down; Lightning's handler would broadcast
            self._finish_rows(trainer)
            return
        self._agreement.cancel()  # a peer may be gone: never wait for the exchange in flight
        self._flag.restore()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._partials.after_batch(trainer)
        if not is_step_boundary(trainer):
            return
        progress = trainer.fit_loop.epoch_loop.batch_progress
        last = bool(progress.is_last_batch) or progress.current.ready >= trainer.num_training_batches
        agreed = trainer.strategy.agreed_flag() if implements(trainer.strategy, StepAgreement) else None
        if agreed is not None:  # agreed in the strategy's own round for this batch: no round of ours
            signum = max(agreed, self._agreement.poll(0, start=False))
        elif last:  # the epoch ends on an agreed state
            signum = self._agreement.settle(self._flag.signum)
        else:
            signum = self._agreement.at_boundary(self._flag.signum)
        step_due = bool(self.every_n_train_steps) and trainer.global_step % self.every_n_train_steps == 0
        if last:
            # Lightning resumes one taken here in the next epoch, skipping validation: taken at on_train_epoch_end
            self._due = (signum, step_due) if signum or step_due else None
            return
        self._checkpoint(trainer, signum, step_due)

    def _checkpoint(self, trainer: pl.Trainer, signum: int, step_due: bool) -> None:
        step = trainer.global_step
        if signum:
            path = self._save(trainer, f"step-{step}-preempted.ckpt")
            if trainer.is_global_zero:
                log.warning("preempted by signal %d at step %d: checkpoint %s", signum, step, path)
            # raised (and requeued) at the next hook, once this step's metrics are logged; not after the last step
            self._stop = Preempted(signum, str(path))
        elif step_due:
            self._save(trainer, f"step-{step}.ckpt")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._after_step(trainer)
        self._partials.before_batch(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":  # as it always is at a training epoch's start
            self._after_step(trainer)

    on_train_epoch_start = on_validation_start

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._partials.after_batch(trainer)  # names the resumed epoch logged late
        if self._due is not None:  # the epoch's last step, deferred until validation is done
            due, self._due = self._due, None
            # the epoch's metrics first, on every rank: a collective that rank 0's progress bar may have run
            trainer.callback_metrics  # noqa: B018 - read for its effect: the epoch's values computed
            self._checkpoint(trainer, *due)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._agreement.poll(0, start=False)  # the run is complete: a flag agreed only now changes nothing
        if self._stop is not None:
            stop, self._stop = self._stop, None
            if trainer.is_global_zero:
                log.warning("signal %d came at the last step: the run is complete (%s)", stop.signum, stop.checkpoint)
        self._after_step(trainer)

    def _after_step(self, trainer: pl.Trainer) -> None:
        """The step's metrics are logged by now: record the rows of the last checkpoint, stop if agreed."""
        self._finish_rows(trainer)
        if self._stop is not None:
            stop, self._stop = self._stop, None
            requeue = self.requeue == "always" or stop.signum in self._requeue_signals
            if trainer.is_global_zero and self.requeue != "never" and requeue and slurm_job_id() is not None:
                slurm_requeue()
            raise stop

    def _signum(self) -> int:
        return self._flag.signum

    @property
    def signal_received(self) -> int:
        """The first stop signal this rank has received during fitting, 0 for none (read-only)."""
        return self._flag.signum

    def _save(self, trainer: pl.Trainer, name: str) -> Path:
        assert self.dirpath is not None
        path = Path(self.dirpath) / name
        trainer.save_checkpoint(path, weights_only=False)  # the full state (and no log line about it)
        self._pending_paths.append(str(path))
        if trainer.is_global_zero:
            # this callback's newest `keep` step checkpoints stay, by the checkpoint IO's write order
            ours = sorted((p for p in path.parent.iterdir() if _STEP_FILE.match(p.name) and p != path), key=write_order)
            for old in ours[: max(len(ours) - (self.keep - 1), 0)]:
                remove_checkpoint_file(old)
        return path

    @override
    def state_dict(self) -> dict[str, Any]:
        # no collective: only rank 0's count matters; the epoch sums are per rank (PER_RANK, gathered at save)
        if (trainer := self._trainer) is None:
            return {"metrics_rows": None, PER_RANK: None}
        return {"metrics_rows": _logged_rows(trainer), PER_RANK: EpochPartials.save(trainer)}

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # the checkpoint being written now gets its final row count at the next hook
        self._rows_pending = True

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if trainer.state.fn != "fit":
            # `test`/`validate`/`predict(ckpt_path=...)` only load weights: no resume, no rows cut
            return
        self.resumed_from = str(trainer.ckpt_path) if trainer.ckpt_path else None
        callbacks = checkpoint.get("callbacks", {})
        state: dict[str, Any] = next((v for k, v in callbacks.items() if k.startswith(type(self).__name__)), {})
        parts = state.get(PER_RANK)
        if isinstance(parts, dict) and trainer.world_size == 1:  # one rank's, under a strategy that does not gather
            parts = [parts]
        if isinstance(parts, list):  # every rank's
            self._partials.load(parts, trainer)
        if not trainer.is_global_zero:
            return
        rows = state.get("metrics_rows")
        if self.resumed_from is not None:
            ledger = read_json(Path(self.resumed_from).parent / ROWS_LEDGER)
            rows = ledger.get(Path(self.resumed_from).name, rows)
        logger = _csv_logger(trainer)
        if rows is not None and logger is not None:
            dropped = truncate_csv_rows(Path(logger.log_dir) / ExperimentWriter.NAME_METRICS_FILE, int(rows))
            if dropped:
                log.info("metrics: dropped %d row(s) logged after the checkpoint", dropped)

    def _finish_rows(self, trainer: pl.Trainer) -> None:
        if not self._rows_pending:
            return
        self._rows_pending = False
        strategy, paths, self._pending_paths = trainer.strategy, self._pending_paths, []
        if implements(strategy, SavesCheckpoints):
            paths, self._counted = strategy.checkpoint_paths[self._counted :], len(strategy.checkpoint_paths)
        if not paths or (rows := _logged_rows(trainer)) is None:  # None on every rank but 0
            return
        for folder in dict.fromkeys(Path(path).parent for path in paths):  # one ledger per folder
            ledger_path = folder / ROWS_LEDGER
            ledger = {name: n for name, n in read_json(ledger_path).items() if (folder / name).exists()}
            ledger.update((Path(path).name, rows) for path in paths if Path(path).parent == folder)
            write_text_atomic(ledger_path, json.dumps(ledger, indent=1, sort_keys=True))


def _csv_logger(trainer: pl.Trainer) -> CSVLogger | None:
    return next((logger for logger in trainer.loggers if isinstance(logger, CSVLogger)), None)


def _logged_rows(trainer: pl.Trainer) -> int | None:
    """Rows the CSV logger has been given so far (written out first), on rank 0; None elsewhere."""
    logger = _csv_logger(trainer)
    if logger is None or not trainer.is_global_zero:
        return None
    logger.save()
    return count_csv_rows(Path(logger.log_dir) / ExperimentWriter.NAME_METRICS_FILE)
