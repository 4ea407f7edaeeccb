"""The warm start of the tests' app runs (tests/helpers/warm.py) gives what a fresh start gives."""

import sys
import time

import pytest

from ddp_plugins.testing import run_command
from tests.helpers.warm import APP, run_warm

# A module in the test's folder: `python -m shown` finds it through sys.path[0], the folder.
SHOWN = """
import os, sys
import __main__
print(sys.argv, __main__.__spec__.name, __name__, sys.path[0], os.getcwd(), os.environ.get("SHOWN"))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_warm_start_prints_and_exits_as_a_fresh_one(tmp_path):
    (tmp_path / "shown.py").write_text(SHOWN)
    cmd = [sys.executable, "-m", "shown", "3", "an argument"]
    env = {"SHOWN": "this environment", "PATH": "/usr/bin:/bin"}
    fresh, warm = run_command(cmd, timeout=60, env=env, cwd=tmp_path), run_warm(cmd, timeout=60, env=env, cwd=tmp_path)
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 3 and "'an argument'] shown __main__" in fresh.stdout, fresh.stdout
    assert "this environment" in fresh.stdout and fresh.stderr == "to stderr\n"


def test_a_warm_app_refuses_bad_input_as_a_fresh_one(tmp_path):
    cmd = [*APP, "backend=foo"]
    fresh, warm = run_command(cmd, timeout=60, cwd=tmp_path), run_warm(cmd, timeout=60, cwd=tmp_path)
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert warm.returncode == 2 and warm.stderr.startswith("error: backend got 'foo'")


def test_a_warm_run_ends_when_every_process_holding_its_output_has_ended(tmp_path):
    """As ``run_command`` reads its pipes to the end: a child that outlives the module is waited for."""
    (tmp_path / "lingers.py").write_text(
        "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3); print(\"late\")'])\n"
    )
    start = time.monotonic()
    result = run_warm([sys.executable, "-m", "lingers"], timeout=60, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == "late\n" and time.monotonic() - start >= 3


def test_a_warm_run_past_its_timeout_is_killed_and_fails(tmp_path):
    (tmp_path / "hangs.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(120)\n")
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"did not finish within 2s \(hang\)(.|\n)*started"):
        run_warm([sys.executable, "-m", "hangs"], timeout=2, cwd=tmp_path)
    assert time.monotonic() - start < 30
    (tmp_path / "shown.py").write_text(SHOWN)  # the server serves the next command
    assert run_warm([sys.executable, "-m", "shown", "0"], timeout=60, cwd=tmp_path).returncode == 0


# A module that starts child processes as the app's launcher starts its child ranks: `sys.executable -m`.
LAUNCHES = """
import os, signal, subprocess, sys, time
env = {**os.environ, "SHOWN": "the child's environment"}
child = subprocess.Popen([sys.executable, "-m", "shown", "5", "child"], env=env, stderr=subprocess.PIPE)
print("its stderr:", child.stderr.read().decode().strip(), "its exit code:", child.wait(), flush=True)
for how in ("terminate", "kill itself"):
    child = subprocess.Popen([sys.executable, "-m", "sleeps", how])
    if how == "terminate":
        time.sleep(2)
        child.terminate()
    print(how, child.wait(), flush=True)
print(subprocess.run([sys.executable, "-c", "print('a script runs fresh')"], capture_output=True, text=True).stdout)
"""
SLEEPS = """
import os, signal, sys, time
print("imported before:", "fresh" if "torch" not in sys.modules else "warm", file=sys.stderr, flush=True)
if sys.argv[1] == "kill itself":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def test_a_warm_run_s_child_starts_warm_and_exits_as_a_fresh_child(tmp_path):
    """Its child ranks fork from the run's zygote: same output, exit codes and signals as fresh children."""
    (tmp_path / "shown.py").write_text(SHOWN)
    (tmp_path / "launches.py").write_text(LAUNCHES)
    (tmp_path / "sleeps.py").write_text(SLEEPS)
    cmd = [sys.executable, "-m", "launches"]
    fresh, warm = run_command(cmd, timeout=60, cwd=tmp_path), run_warm(cmd, timeout=60, cwd=tmp_path)
    assert fresh.stderr.count("imported before: fresh") == 2, fresh.stderr
    assert warm.stderr.count("imported before: warm") == 2, warm.stderr
    assert (warm.returncode, warm.stdout) == (fresh.returncode, fresh.stdout)
    assert fresh.stdout.splitlines() == [
        f"['{tmp_path}/shown.py', '5', 'child'] shown __main__ {tmp_path} {tmp_path} the child's environment",
        "its stderr: to stderr its exit code: 5",
        "terminate -15",
        "kill itself -9",
        "a script runs fresh",
        "",
    ], fresh.stdout
