"""The private Slurm test cluster (tests/helpers/slurm.py) keeps to itself: it writes nothing under
/etc, signals only the daemons it started, and runs a real job."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.slurm import SlurmCluster, SlurmUnavailable


def _tree_digest(root: Path) -> dict[str, str]:
    if not root.exists():
        return {}
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slurm
def test_the_test_cluster_runs_a_job_and_leaves_etc_and_other_processes_alone(tmp_path):
    decoy_exe = tmp_path / "slurmctld"  # a process a name-based pkill would hit
    shutil.copy(shutil.which("sleep"), decoy_exe)
    decoy = subprocess.Popen([str(decoy_exe), "300"])
    etc_before = _tree_digest(Path("/etc/slurm"))
    try:
        try:
            cluster = SlurmCluster(tmp_path / "cluster")
            cluster.start()
        except SlurmUnavailable as error:
            pytest.skip(f"no Slurm test cluster: {error}")
        try:
            env = {**os.environ, **cluster.env}
            job = subprocess.run(["srun", "-n2", "hostname"], env=env, capture_output=True, text=True, timeout=120)
            assert job.returncode == 0 and len(job.stdout.split()) == 2, job
            daemons = cluster.pids
        finally:
            cluster.stop()
        assert cluster.step_daemons() == [], "a job step's slurmstepd outlived the cluster"
        for pid in daemons:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid
        assert decoy.poll() is None, "the test cluster signalled a process it did not start"
        assert _tree_digest(Path("/etc/slurm")) == etc_before, "the test cluster wrote /etc/slurm"
        assert (tmp_path / "cluster" / "slurm.conf").exists() and "SlurmctldPort=" in (
            tmp_path / "cluster" / "slurm.conf"
        ).read_text()
    finally:
        decoy.kill()
        decoy.wait()
