"""Checkpoint helpers: per-rank state, the latest checkpoint of a folder, metrics rows
===================================================================================

* **Per-rank state without a collective in ``state_dict``.** A component whose state differs per
  rank (RNG streams) puts this rank's part under the key :data:`PER_RANK` of its state dict.
  :func:`gather_per_rank` is then called once by every rank where all ranks are known to be in
  step (the strategy's ``save_checkpoint``, which every rank reaches through
  ``Trainer.save_checkpoint``) and replaces each such part with the list of every rank's.
  ``state_dict`` itself never communicates, so a checkpoint taken from any synchronized point
  cannot deadlock.
* :func:`latest_checkpoint`: the newest ``*.ckpt`` of a folder (the last one written).
* :func:`count_csv_rows` / :func:`truncate_csv_rows`: a metrics CSV cut back to the rows logged
  before a checkpoint, so a resumed run neither loses nor repeats a row.

Plain torch and the standard library.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "PER_RANK",
    "count_csv_rows",
    "gather_per_rank",
    "latest_checkpoint",
    "read_json",
    "truncate_csv_rows",
    "write_text_atomic",
]

PER_RANK = "per_rank"


def _per_rank_slots(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The state dicts of the checkpoint's callbacks that hold a :data:`PER_RANK` part, in a fixed order."""
    callbacks = checkpoint.get("callbacks") or {}
    states = [callbacks[key] for key in sorted(callbacks)]
    return [state for state in states if isinstance(state, dict) and PER_RANK in state]


def gather_per_rank(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Replace every callback's :data:`PER_RANK` part with the list of all ranks' parts (in place).

    One ``all_gather_object`` for all of them; every rank must call it at the same point. Without
    a process group each part becomes a one-element list.

    Example::

        >>> gather_per_rank({"callbacks": {"Seed": {"per_rank": {"s": 1}, "seed": 3}}})
        {'callbacks': {'Seed': {'per_rank': [{'s': 1}], 'seed': 3}}}
    """
    slots = _per_rank_slots(checkpoint)
    if not slots:
        return checkpoint
    mine = [slot[PER_RANK] for slot in slots]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    for index, slot in enumerate(slots):
        slot[PER_RANK] = [rank_parts[index] for rank_parts in gathered]
    return checkpoint


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The ``*.ckpt`` file of ``folder`` written last (None if there is none).

    Checkpoints are renamed into place once complete, so every one found is whole; temporary
    files (hidden names) are ignored. A later write is a later point of training, also across
    restarts of the same run.

    Example::

        >>> import tempfile, time
        >>> folder = Path(tempfile.mkdtemp())
        >>> for name in ("epoch=0.ckpt", "step=12.ckpt"):
        ...     _ = (folder / name).write_text("x"); time.sleep(0.01)
        >>> latest_checkpoint(folder).name
        'step=12.ckpt'
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    found = [p for p in folder.glob("*.ckpt") if not p.name.startswith(".") and p.is_file()]
    return max(found, key=lambda p: (p.stat().st_mtime_ns, p.name)) if found else None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and rename: never half-written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", newline="") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when the file is missing or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def count_csv_rows(path: str | os.PathLike) -> int:
    """Data rows (not the header) of a CSV file; 0 when it does not exist.

    Example::

        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "m.csv"
        >>> count_csv_rows(path)
        0
        >>> _ = path.write_text("step,loss\\n0,1.5\\n1,1.2\\n")
        >>> count_csv_rows(path)
        2
    """
    try:
        with open(path, newline="") as file:
            return max(sum(1 for _ in csv.reader(file)) - 1, 0)
    except FileNotFoundError:
        return 0


def truncate_csv_rows(path: str | os.PathLike, rows: int) -> int:
    """Keep the header and the first ``rows`` data rows of a CSV file (atomically); returns rows dropped.

    Example::

        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "m.csv"
        >>> _ = path.write_text("step,loss\\n0,1.5\\n1,1.2\\n2,1.1\\n")
        >>> truncate_csv_rows(path, 1), path.read_text().splitlines()
        (2, ['step,loss', '0,1.5'])
    """
    try:
        with open(path, newline="") as file:
            table = list(csv.reader(file))
    except FileNotFoundError:
        return 0
    if len(table) <= rows + 1:
        return 0
    out = io.StringIO()
    csv.writer(out).writerows(table[: rows + 1])
    write_text_atomic(path, out.getvalue())
    return len(table) - rows - 1
