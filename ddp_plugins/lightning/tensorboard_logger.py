"""A ``TensorBoardLogger`` whose event stream a resumed run continues."""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import struct
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

__all__ = ["ResumableTensorBoardLogger"]

_WRITERS = (("tensorboard", "torch.utils.tensorboard"), ("tensorboardX", "tensorboardX"))  # Lightning's order


def writer_problem() -> str | None:
    """Why Lightning's TensorBoard writer cannot be used (one line), or None; imported, as an installed one may fail."""
    for package, module in _WRITERS:
        if importlib.util.find_spec(package) is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - an import can fail in any way; the caller reports one line
            first = " ".join(str(err).split())[:200]
            return f"{package} is installed but does not import ({type(err).__name__}: {first})"
        return None
    return "tensorboardX (or tensorboard) is not installed"


def _events_in(folder: str) -> set[str]:
    return set(glob.glob(os.path.join(glob.escape(folder), "events.out.tfevents.*")))


class _SynchronousEvents:
    """tensorboardX's ``event_writer`` without its queue, whose thread its ``flush()`` does not wait for (``kill -9``
    lost points): ``add_event`` returns with the TFRecord in the file, ``flush`` fsyncs."""

    def __init__(self, path: str, logdir: str) -> None:
        from tensorboardX.record_writer import masked_crc32c

        self._crc, self._path, self._logdir = masked_crc32c, path, logdir
        self._lock = threading.Lock()
        self._file: Any = open(path, "ab")

    def get_logdir(self) -> str:
        return self._logdir

    def add_event(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        record = header + struct.pack("<I", self._crc(header)) + data + struct.pack("<I", self._crc(data))
        with self._lock:
            if not self._file.closed:
                self._file.write(record)
                self._file.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._file.close()

    def reopen(self) -> None:
        with self._lock:
            if self._file.closed:
                self._file = open(self._path, "ab")


class ResumableTensorBoardLogger(TensorBoardLogger):
    """``TensorBoardLogger`` (same arguments) whose event stream a resumed run continues.

    Each launch writes its own event file and marks its first step as a restart (docs/design.md, "Checkpoints and
    resume"). ``hp_metric`` is off: it would log step 0 at every launch. With tensorboardX, ``kill -9`` loses nothing.

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
            # tensorboardX names a file by its second and host only: a count keeps each launch's new, in order
            before = _events_in(self.log_dir)
            self._kwargs["filename_suffix"] = f".{len(before)}{self._suffix}"
            writer = super().experiment
            opened = sorted(_events_in(self.log_dir) - before)
            if type(writer).__module__.split(".")[0] == "tensorboardX" and len(opened) == 1:
                # its file, closed by its own writer (header written), continued by one that writes at once
                file_writer = writer.file_writer
                file_writer.event_writer.close()
                file_writer.event_writer = _SynchronousEvents(opened[0], file_writer.get_logdir())
        return super().experiment

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not self._continued and step is not None:
            # the SessionLog.START that `SummaryWriter(purge_step=step)` writes (Lightning opened it before the restore)
            self._continued = True
            writer = self.experiment
            if type(writer).__module__.split(".")[0] == "tensorboardX":
                from tensorboardX.proto.event_pb2 import Event, SessionLog
            else:  # torch.utils.tensorboard, which Lightning prefers when `tensorboard` is installed
                from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            start = SessionLog(status=SessionLog.START)
            writer.file_writer.add_event(Event(step=int(step), wall_time=time.time(), session_log=start))
        super().log_metrics(metrics, step)
