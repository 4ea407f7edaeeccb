"""A ``CSVLogger`` whose ``metrics.csv`` a resumed run continues."""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from typing_extensions import override

from ddp_plugins.core.files import write_text_atomic

__all__ = ["ResumableCSVLogger"]


class _AppendingWriter(ExperimentWriter):
    """``ExperimentWriter`` that continues an existing metrics file instead of deleting it."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as file:
                self.metrics_keys = list(next(csv.reader(file), []))

    @override
    def _check_log_dir_exists(self) -> None:
        pass  # the file is the run's own history: keep it

    @override
    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        with open(self.metrics_file_path, newline="") as file:
            rows = list(csv.DictReader(file))
        self.metrics_keys = keys = sorted(set(fieldnames).union(*(row.keys() for row in rows)))
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
        write_text_atomic(self.metrics_file_path, out.getvalue())


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` survives a resume (same arguments as ``CSVLogger``).

    Lightning's deletes an existing ``metrics.csv`` and rewrites it with this process's keys; this one keeps it
    and widens its header (:class:`~ddp_plugins.lightning.PreemptionCheckpoint` cuts the rows back first).

    Example::

        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> for step in range(2):  # two runs in the same folder: the second continues the file
        ...     logger = ResumableCSVLogger(folder, name="m", version="")
        ...     logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        ...     logger.save()
        >>> open(os.path.join(folder, "m", "metrics.csv")).read().split()
        ['loss,step', '1.0,0', '0.5,1']
    """

    @property
    @rank_zero_experiment
    @override
    def experiment(self) -> Any:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
