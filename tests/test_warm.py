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
