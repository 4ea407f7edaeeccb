"""Metrics of the pack's monitoring callbacks, written to the Trainer's loggers directly."""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl

from ddp_plugins import _compat


def log_to_loggers(trainer: pl.Trainer, metrics: Mapping[str, float]) -> None:
    """Hand ``metrics`` to every logger of ``trainer`` at the current batch's step (not in ``callback_metrics``).

    As ``LearningRateMonitor`` does, since ``LightningModule.log`` is slow per call (docs/plugins.md)."""
    if not metrics:
        return
    step = _compat.logger_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=step)
