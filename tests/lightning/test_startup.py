"""A start-up never waits on a dead rank: the launcher ends the job within seconds, in one line.

Each case runs a plain Lightning script on 2 CPU ranks started by the pack's subprocess launcher,
with the default rendezvous timeout (30 minutes): a hang fails at the subprocess timeout instead.
Child rank 1 dies at a chosen point of its start-up and writes the time it died on its last line.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.lightning.launchers import _check_rerunnable, _StderrTee
from ddp_plugins.testing import loopback_env
from tests.helpers import REPO_ROOT

ENDS_WITHIN_S = 10.0  # from the child rank's death (or the fit call) to the job's end
HANG_S = 60.0  # a start-up that waits on the dead rank fails here, not after the rendezvous timeout

# Rank 1 (LOCAL_RANK=1) runs DIES where the script reaches it: at the top of the script (before it
# imports Lightning) or in the module's `setup` hook (after the rendezvous, before the model is in sync).
# A short stall limit has the liveness room judge every third of a second: in `setup` it sees the gone
# rank before the launcher's watcher does, and must leave the one line to it.
SCRIPT = """\
import os, signal, sys, time
WHERE, HOW = {where!r}, {how!r}


def die():
    if os.environ.get("LOCAL_RANK") != "1":
        return
    lines = {{
        "killed": "rank 1 goes down now",
        "exit 2": "python: can't open file '/nowhere/-': [Errno 2] No such file or directory",
        "refusal": "error: trainer.devices got 2, allowed: 1",
    }}
    print(f"{{lines[HOW]}} (at {{time.time():.3f}})", file=sys.stderr, flush=True)
    if HOW == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(2)


if WHERE == "top":
    die()

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
from ddp_plugins.lightning import DDPPluginsStrategy


class Model(BoringModel):
    def setup(self, stage):
        if WHERE == "setup":
            die()


if __name__ == "__main__":
    trainer = pl.Trainer(
        strategy=DDPPluginsStrategy(stall_name_after=2.0), accelerator="cpu", devices=2, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    print(f"fit at {{time.time():.3f}}", file=sys.stderr, flush=True)
    trainer.fit(Model())
"""


def _run(tmp_path: Path, where: str, how: str, stdin: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    """The script's run (``python - < script.py`` with ``stdin``), and the time it ended."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(where=where, how=how))
    command = [sys.executable, "-"] if stdin else [sys.executable, str(script)]
    with open(script) as source:
        proc = subprocess.Popen(
            command, stdin=source if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=loopback_env(), cwd=tmp_path, start_new_session=True,
        )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=HANG_S)
    finally:  # a hang leaves no rank behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr), time.time()


def _at(pattern: str, stderr: str) -> float:
    found = re.search(pattern + r".*\(at ([\d.]+)\)", stderr) or re.search(pattern + r" at ([\d.]+)", stderr)
    assert found, f"no {pattern!r} line in stderr:\n{stderr[-3000:]}"
    return float(found.group(1))


def _launcher_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("[ddp_plugins] rank 1 ")]
    assert len(lines) == 1, f"expected one launcher line about rank 1, got {lines}:\n{stderr[-3000:]}"
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("where", "how", "says"),
    [
        # rank 0 waits in the rendezvous for a rank that never comes: the launcher ends the job
        ("top", "killed", "was killed by signal SIGKILL while the ranks were starting"),
        ("top", "exit 2", "exited with code 2 while the ranks were starting"),  # Python's, as under `python -`
        # rank 0 waits in a barrier or fails there first (gloo saw the peer go): either names rank 1's line
        pytest.param("setup", "killed", "was killed by signal SIGKILL", marks=pytest.mark.e2e),  # 34 s
    ],
)
def test_a_child_rank_that_dies_during_startup_ends_the_job(tmp_path, where, how, says):
    done, ended = _run(tmp_path, where, how)
    died = _at("rank 1 goes down now" if how == "killed" else "can't open file", done.stderr)
    assert ended - died < ENDS_WITHIN_S, f"the job ended {ended - died:.1f} s after rank 1 died:\n{done.stderr[-3000:]}"
    assert done.returncode == 1, f"exit code {done.returncode}:\n{done.stderr[-3000:]}"
    line = _launcher_line(done.stderr)
    assert says in line and "its last stderr line: " in line, line
    assert line.endswith(f"(at {died:.3f})"), f"the child rank's last stderr line is not named: {line}"
    assert "RendezvousError" not in done.stderr, done.stderr[-3000:]
    # one line for one failure: the liveness room (started once the ranks met) leaves it to the launcher
    # (6581d93 on CI: the room spoke first, wrote a step-0 checkpoint, and the launcher's line never came)
    assert "error: " not in done.stderr and "stalled.ckpt" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_child_rank_that_refuses_during_startup_ends_the_job_as_a_refusal(tmp_path):
    # rank 1 refused with one `error: ...` line; rank 0 did not (it waits in the rendezvous): after a
    # short grace, the job ends with the refusal's exit code and the child rank's line
    done, ended = _run(tmp_path, "top", "refusal")
    died = _at("error: trainer.devices", done.stderr)
    took = ended - died
    assert took < ENDS_WITHIN_S, f"the job ended {took:.1f} s after rank 1 refused:\n{done.stderr[-3000:]}"
    assert done.returncode == 2, f"exit code {done.returncode}:\n{done.stderr[-3000:]}"
    line = _launcher_line(done.stderr)
    assert "exited with code 2 (a refusal) while the ranks were starting" in line, line
    assert line.endswith(f"its last stderr line: error: trainer.devices got 2, allowed: 1 (at {died:.3f})"), line


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_script_from_stdin_is_refused_before_any_child_starts(tmp_path):
    done, ended = _run(tmp_path, "nowhere", "killed", stdin=True)
    fit = _at("fit", done.stderr)
    assert ended - fit < ENDS_WITHIN_S, f"refused {ended - fit:.1f} s after the fit call:\n{done.stderr[-3000:]}"
    assert done.returncode == 1, f"exit code {done.returncode}:\n{done.stderr[-3000:]}"
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ddp_plugins.core.checks.ArgumentValueError: `sys.argv[0]` should be a script file"), last
    assert "got '-'" in last and "python -m" in last and "torchrun" in last and "ddp_plugins_notebook" in last, last
    assert "[ddp_plugins] rank 1" not in done.stderr, done.stderr[-3000:]  # no child rank ever started


def test_child_commands_that_cannot_be_rerun_are_refused(monkeypatch, tmp_path):
    python = sys.executable
    monkeypatch.setattr(sys, "argv", ["-c", "x"])
    with pytest.raises(ArgumentValueError, match=r"got '-c' \(`python -c` keeps no copy of its code"):
        _check_rerunnable([python, str(tmp_path / "-c"), "x"], None)
    _check_rerunnable([python, "-m", "package.module", "x"], None)  # a module is found again by name

    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(ArgumentValueError, match=r"got 'train.py', and '.*train.py' is not a file\."):
        _check_rerunnable([python, str(tmp_path / "train.py")], None)
    (tmp_path / "train.py").write_text("")
    _check_rerunnable([python, str(tmp_path / "train.py")], None)
    _check_rerunnable([python, "train.py"], str(tmp_path))  # Hydra's: relative to the original folder


def test_the_stdin_refusal_names_the_alternatives(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["-"])
    with pytest.raises(ArgumentValueError) as refused:
        _check_rerunnable([sys.executable, str(REPO_ROOT / "-")], None)
    assert str(refused.value) == (
        "`sys.argv[0]` should be a script file that each child rank re-runs, got '-' (`python -` reads the script"
        " from stdin, which no child rank can read again). Save the script to a file and run `python file.py`, run"
        " it as a module (`python -m package.module`), start the ranks with torchrun, or use"
        " strategy='ddp_plugins_notebook' (forked ranks: nothing re-run)."
    )


def test_a_child_ranks_startup_stderr_is_passed_on_and_its_last_line_kept(tmp_path):
    read, write = os.pipe()
    with open(tmp_path / "stderr", "wb") as target:
        tee = _StderrTee(os.fdopen(read, "rb"), os.dup(target.fileno()))
        tee.start()
        os.write(write, b"Traceback (most recent call last):\n  ...\nValueError: boom\n\n  \r")
        os.close(write)
        assert tee.last_line(5.0) == "ValueError: boom", "the last non-blank line should be kept"
    assert not tee.is_alive(), "the tee should end with its child rank's stderr"
    assert (tmp_path / "stderr").read_bytes().endswith(b"ValueError: boom\n\n  \r"), "every byte should pass on"
