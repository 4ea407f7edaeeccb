"""A ``TensorBoardLogger`` whose event stream a resumed run continues."""

from __future__ import annotations

import glob
import importlib.util
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

__all__ = ["ResumableTensorBoardLogger"]


def writer_installed() -> bool:
    """Whether a TensorBoard writer package (``tensorboard`` or ``tensorboardX``) can be imported."""
    return any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))


class ResumableTensorBoardLogger(TensorBoardLogger):
    """``TensorBoardLogger`` (same arguments) whose event stream a resumed run continues.

    Every launch writes its own event file into one folder (``version=""``) and marks the first step
    it logs with ``SummaryWriter(purge_step=step)``'s restart event, so a resumed run shows each step
    once (docs/design.md). ``hp_metric`` is off: it would log step 0 at every launch.

    Raises:
        ModuleNotFoundError: neither ``tensorboard`` nor ``tensorboardX`` is installed.

    Example::

        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> for steps in ([0, 1, 2], [1, 2, 3]):  # the second launch resumed at step 1
        ...     logger = ResumableTensorBoardLogger(folder, name="tensorboard", version="")
        ...     for step in steps:
        ...         logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        ...     logger.finalize("success")
        >>> sorted(name.rsplit(".", 1)[1] for name in os.listdir(os.path.join(folder, "tensorboard")))
        ['0', '1', 'yaml']
    """

    def __init__(
        self, save_dir: str | Path, name: str | None = "lightning_logs", version: int | str | None = None, **kwargs: Any
    ) -> None:
        self._suffix = str(kwargs.pop("filename_suffix", ""))
        super().__init__(save_dir, name=name, version=version, default_hp_metric=False, **kwargs)
        self._continued = False  # this launch has written its restart marker

    @property
    @override
    def experiment(self) -> Any:
        if self._experiment is None:
            # tensorboardX names a file by the second it opened and the host only: a launch within the
            # same second would overwrite the last one's file. A count keeps the names new and in order.
            launches = len(glob.glob(os.path.join(glob.escape(self.log_dir), "events.out.tfevents.*")))
            self._kwargs["filename_suffix"] = f".{launches}{self._suffix}"
        return super().experiment

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not self._continued and step is not None:
            # Append the event `SummaryWriter(purge_step=step)` writes first: a SessionLog.START at `step`
            # (Lightning opens the writer when the fit starts, before the checkpoint is restored)
            self._continued = True
            writer = self.experiment
            if type(writer).__module__.split(".")[0] == "tensorboardX":
                from tensorboardX.proto.event_pb2 import Event, SessionLog
            else:  # torch.utils.tensorboard, which Lightning prefers when `tensorboard` is installed
                from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            start = SessionLog(status=SessionLog.START)
            writer.file_writer.add_event(Event(step=int(step), wall_time=time.time(), session_log=start))
        super().log_metrics(metrics, step)
