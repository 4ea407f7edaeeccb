"""The row ledger: which training rows each epoch of an app run trained, across stops and resumes.

Added to the app on the command line (``+callbacks.ledger._target_=tests.helpers.ledger.RowLedger``).
Every rank appends one line per trained micro-batch to ``<run folder>/rows-rank<R>.jsonl``: the
epoch and the indices of its rows in the datamodule's training set (found by their images, which
are distinct in the demo data). A run and the runs resumed after it append to the same files, so
:func:`rows_per_epoch` reads what the whole job trained, to compare with an uninterrupted run's.
A batch is written at its ``on_train_batch_end``, which a stop's checkpoint includes (the stop is
raised at the next hook).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback


class RowLedger(Callback):
    """Append the row indices of every trained micro-batch, per rank, to the run folder."""

    def __init__(self) -> None:
        self._index: dict[bytes, int] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        images = trainer.datamodule.train_set.tensors[0]
        self._index = {_key(image): i for i, image in enumerate(images)}
        assert len(self._index) == len(images), "the ledger needs distinct training images"

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        rows = [self._index[_key(image)] for image in batch[0]]
        line = json.dumps({"epoch": trainer.current_epoch, "batch": batch_idx, "rows": rows})
        with open(Path(trainer.default_root_dir) / f"rows-rank{trainer.global_rank}.jsonl", "a") as file:
            file.write(line + "\n")


def _key(image: Any) -> bytes:
    return image.detach().cpu().float().numpy().tobytes()  # the stored float32 image, also under 64-true


def batches_of(run_dir: str | Path, rank: int, epoch: int) -> list[list[int]]:
    """The rows of each micro-batch that ``rank`` trained in ``epoch``, in order (every run in the folder)."""
    lines = (Path(run_dir) / f"rows-rank{rank}.jsonl").read_text().splitlines()
    return [entry["rows"] for entry in map(json.loads, lines) if entry["epoch"] == epoch]


def rows_per_epoch(run_dir: str | Path) -> dict[int, Counter]:
    """How many times each row was trained in each epoch, over every rank and every run in the folder."""
    epochs: dict[int, Counter] = {}
    for path in sorted(Path(run_dir).glob("rows-rank*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            epochs.setdefault(entry["epoch"], Counter()).update(entry["rows"])
    return epochs
