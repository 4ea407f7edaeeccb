"""A signal to the app's launcher while its ranks start leaves no process behind.

The launcher is rank 0 and starts rank 1 itself. SIGTERM reached it anywhere in start-up: before
rank 1 exists (nothing of ours runs yet: killed by the signal), while rank 1 imports or waits in the
rendezvous (the launcher stops it and exits 143), or later (training's preemption handling, or the
run already finished). SIGKILL of the launcher: rank 1 dies with it (its parent-death signal).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddp_plugins.testing import loopback_env
from tests.helpers import REPO_ROOT
from tests.helpers.warm import APP

SMALL = [
    "data=synthetic", "data.num_samples=640", "model.channels=8", "trainer.max_epochs=1",
    "trainer.enable_progress_bar=false",
]  # fmt: skip
GONE_WITHIN_S = 10.0


def _stat(pid: str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, session, ...)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _session(sid: int) -> dict[int, str]:
    """The live (not zombie) processes of session ``sid``, with their command lines."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(pid)
        if fields is not None and fields[0] != "Z" and int(fields[3]) == sid:
            with contextlib.suppress(OSError):
                found[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return found


def _rank1(sid: int) -> int | None:
    """The PID of child rank 1 in session ``sid`` (its command names the job ``<name>_rank1``)."""
    for pid, cmdline in _session(sid).items():
        if any(arg.startswith("hydra.job.name=") and arg.endswith("_rank1") for arg in cmdline.split()):
            return pid
    return None


def _wait_for(condition: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := condition()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return result


@contextlib.contextmanager
def _app(tmp_path: Path):
    """The app in a session of its own, output to files; whatever is left of it is killed after."""
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(
            [*APP, *SMALL, f"hydra.run.dir={tmp_path / 'run'}"],
            env=loopback_env(), cwd=REPO_ROOT, stdout=out, stderr=err, start_new_session=True,
        )  # fmt: skip
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _assert_all_gone(proc: subprocess.Popen, tmp_path: Path, what: str) -> None:
    left = _wait_for(lambda: not _session(proc.pid), GONE_WITHIN_S) or _session(proc.pid)
    assert left is True, (
        f"{what}: processes still running {GONE_WITHIN_S:.0f} s later: {left}\n"
        f"--- stderr ---\n{(tmp_path / 'err.txt').read_text()[-3000:]}"
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("when", [0.5, 2.5, 5.0, "once rank 1 runs"])
def test_sigterm_during_startup_leaves_no_process(tmp_path, when):
    with _app(tmp_path) as proc:
        if isinstance(when, str):
            assert _wait_for(lambda: _rank1(proc.pid), 120), "rank 1 never started"
        else:
            time.sleep(when)
        rank1_started = _rank1(proc.pid) is not None
        os.kill(proc.pid, signal.SIGTERM)
        _assert_all_gone(proc, tmp_path, f"SIGTERM to the launcher at {when}")
        code = proc.wait(timeout=5)
    stderr = (tmp_path / "err.txt").read_text()
    # Before rank 1 exists the launcher may still be importing: the signal's default action ends it.
    allowed = {143, 0} if rank1_started else {143, 0, -signal.SIGTERM}
    assert code in allowed, f"exit code {code} (rank 1 started: {rank1_started}), allowed {allowed}\n{stderr[-3000:]}"
    if when == "once rank 1 runs":
        assert code == 143 and "SIGTERM while the ranks were starting" in stderr, stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_of_the_launcher_takes_rank1_with_it(tmp_path):
    with _app(tmp_path) as proc:
        rank1 = _wait_for(lambda: _rank1(proc.pid), 120)
        assert rank1, "rank 1 never started"
        os.kill(proc.pid, signal.SIGKILL)
        _assert_all_gone(proc, tmp_path, f"SIGKILL to the launcher (rank 1: PID {rank1})")
        assert proc.wait(timeout=5) == -signal.SIGKILL
