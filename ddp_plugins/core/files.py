"""The one atomic write every file of the pack goes through, and small readers of files written that way."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from ddp_plugins.core.checks import check_choice

__all__ = [
    "count_csv_rows",
    "is_temporary",
    "open_atomic",
    "read_json",
    "save_atomic",
    "truncate_csv_rows",
    "write_text_atomic",
]

_TEMPORARY = re.compile(r"^\..+\.\d+\.tmp$")  # the names open_atomic writes to before the rename


def is_temporary(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the temporary file of an atomic write (one a killed writer may have left).

    Example::

        >>> is_temporary(".step-4.ckpt.123.tmp"), is_temporary("step-4.ckpt")
        (True, False)
    """
    return bool(_TEMPORARY.match(Path(path).name))


@contextlib.contextmanager
def open_atomic(
    path: str | os.PathLike, mode: str = "wb", before_rename: Callable[[Path], None] | None = None, **open_kwargs: Any
) -> Iterator[IO[Any]]:
    """Open ``path`` (``mode`` ``"wb"`` or ``"w"``) for writing so that it is never seen half-written.

    A hidden temporary in the same folder, fsynced, passed to ``before_rename``, renamed; on failure ``path`` is
    untouched. By hand: Lightning's fsspec save writes to the system temp folder and never fsyncs.

    Example::

        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "notes" / "a.txt"
        >>> with open_atomic(path, "w") as file:
        ...     _ = file.write("whole")
        >>> path.read_text(), [p.name for p in path.parent.iterdir()]
        ('whole', ['a.txt'])
    """
    check_choice("mode", mode, ("wb", "w"))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode, **open_kwargs) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_atomic(obj: Any, path: str | os.PathLike, before_rename: Callable[[Path], None] | None = None) -> Path:
    """``torch.save`` to ``path`` through :func:`open_atomic`: never half-written.

    Example::

        >>> import tempfile, torch
        >>> path = save_atomic({"step": 3}, Path(tempfile.mkdtemp()) / "state.pt")
        >>> torch.load(path)
        {'step': 3}
        >>> [p.name for p in path.parent.iterdir()]  # no temporary file left behind
        ['state.pt']
    """
    import torch

    with open_atomic(path, "wb", before_rename=before_rename) as file:
        torch.save(obj, file)
    return Path(path)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through :func:`open_atomic` (newlines as given): never half-written."""
    with open_atomic(path, "w", newline="") as file:
        file.write(text)


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
