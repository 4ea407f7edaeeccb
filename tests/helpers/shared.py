"""A run that session fixtures of several xdist workers need, made once per test run."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """``make(folder)`` once per test run; every pytest-xdist worker gets the same, finished folder.

    Each xdist worker runs its own session fixtures, so an app run that tests on both workers
    compare with would run twice. The first worker to ask makes it under a file lock in the run's
    common temporary folder, and the others wait for it (pytest-xdist's documented recipe). A make
    that failed leaves no mark: the next worker to ask tries again, and fails its own test.
    """
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, above each worker's own
    folder, done = base / f"shared-{name}", base / f"shared-{name}.done"
    with FileLock(str(base / f"shared-{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder
