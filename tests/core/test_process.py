"""The clean process exit (``run_main`` / ``exit_process``) that avoids the gloo abort at interpreter exit."""

import json
import subprocess
import sys

import pytest

from ddp_plugins.testing import check_ok, run_command

ROUNDS_PLAIN_MAX = 120
ROUNDS_CLEAN = 30
ROUNDS_ARMED = 15


def _run_rounds(tmp_path, mode: str, rounds: int, stop_at_failure: bool = False) -> list:
    """Run up to ``rounds`` two-rank DDP probes (``tests.helpers.exit_probe``, each rank forked from
    one warm process); return (round, exit code, stderr) of every process that failed or hung."""
    out = tmp_path / f"{mode}.json"
    cmd = [sys.executable, "-m", "tests.helpers.exit_probe", mode, str(rounds), str(out)]
    check_ok(run_command([*cmd, *(["--stop-at-failure"] if stop_at_failure else [])], timeout=600))
    results = json.loads(out.read_text())
    assert len(results) == 2 * rounds or stop_at_failure, f"{len(results)} results of {2 * rounds} processes"
    return [(r["round"], r["code"], r["stderr"]) for r in results if r["code"] != 0]


@pytest.mark.slow
@pytest.mark.e2e
def test_run_main_exits_never_abort(tmp_path):
    """Many short gloo DDP runs ended through ``run_main``: not one process may die at exit.

    Plain exits aborted in about 1 process of 10 on the machine this was written on, so 60 clean
    exits without a failure (90 with the armed test below, the same ``exit_process``) would happen
    by chance with probability ~0.002 (~0.0001) if the fix did nothing.
    """
    clean = _run_rounds(tmp_path, "clean", ROUNDS_CLEAN)
    assert clean == [], f"run_main exits failed in {len(clean)} of {2 * ROUNDS_CLEAN} processes: {clean[:3]}"


@pytest.mark.slow
@pytest.mark.e2e
def test_exits_armed_at_interpreter_exit_never_abort(tmp_path):
    """The same probe returning to the interpreter after ``exit_at_interpreter_exit(0)`` (a job
    run by submitit's entry point): every process exits 0."""
    armed = _run_rounds(tmp_path, "armed", ROUNDS_ARMED)
    assert armed == [], f"armed exits failed in {len(armed)} of {2 * ROUNDS_ARMED} processes: {armed[:3]}"


@pytest.mark.slow
@pytest.mark.hazard_control
def test_plain_exit_probe_reaches_the_hazard(tmp_path):
    """The control: the same probe with a plain exit aborts with the gloo "terminate called" abort.

    It runs until the first abort (at most 240 processes). The hazard is a race at interpreter
    exit whose odds depend on the machine's timing: on 2026-11-22's CI machine it did not strike
    in 240 plain exits, so this control is selected with ``-m hazard_control``, not by default.
    """
    plain = _run_rounds(tmp_path, "plain", ROUNDS_PLAIN_MAX, stop_at_failure=True)
    assert plain, f"no abort in {2 * ROUNDS_PLAIN_MAX} plain exits: the probe no longer reproduces the hazard"
    assert all(code == -6 for _, code, _ in plain), f"unexpected plain failures: {plain[:3]}"
    assert any("terminate called without an active exception" in err for _, _, err in plain)


def test_run_main_keeps_exit_codes_and_flushes_output():
    code = (
        "import sys; from ddp_plugins.core import run_main\n"
        "def main():\n"
        "    print('flushed', end='')\n"
        "    sys.exit(int(sys.argv[1]))\n"
        "run_main(main)\n"
    )
    for wanted in (0, 3):
        result = subprocess.run([sys.executable, "-c", code, str(wanted)], capture_output=True, text=True, timeout=60)
        assert result.returncode == wanted
        assert result.stdout == "flushed", "stdout lost by the hard exit"
    raising = "from ddp_plugins.core import run_main\ndef main():\n    raise RuntimeError('boom')\nrun_main(main)\n"
    result = subprocess.run([sys.executable, "-c", raising], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "RuntimeError: boom" in result.stderr
    atexit_code = (
        "import atexit; from ddp_plugins.core import run_main\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "run_main(lambda: None)\n"
    )
    result = subprocess.run([sys.executable, "-c", atexit_code], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, "atexit ran")


def test_exit_at_interpreter_exit_keeps_the_exit_code_and_runs_every_handler_once():
    def run(body: str) -> subprocess.CompletedProcess:
        code = (
            "import atexit, sys; from ddp_plugins.core.process import exit_at_interpreter_exit\n"
            "atexit.register(lambda: print('early handler', end=';'))\n" + body
        )
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    returned = run("exit_at_interpreter_exit(0); print('job done', end=';')")
    assert (returned.returncode, returned.stdout) == (0, "job done;early handler;")
    stopped = run("exit_at_interpreter_exit(3); exit_at_interpreter_exit(143); raise SystemExit(143)")
    assert (stopped.returncode, stopped.stdout) == (143, "early handler;"), "the last call's code"
    failed = run("exit_at_interpreter_exit(0); raise RuntimeError('after the job')")
    assert failed.returncode == 1 and "RuntimeError: after the job" in failed.stderr
    assert failed.stdout == "early handler;"
