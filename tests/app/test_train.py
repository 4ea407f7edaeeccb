"""The training app end to end: `make train`'s job, Hydra multirun with DDP, two torchrun nodes, the wheel.

Also the command line's answers that start nothing (bad input, --help) and the job helpers of
:mod:`ddp_plugins.app.train`.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_plugins.app.config import compose_config
from ddp_plugins.app.train import _accuracy_key, _reset_job_state
from ddp_plugins.testing import check_ok, free_port, loopback_env, run_command
from tests.app.test_checks import BAD_INPUTS, GROUPS
from tests.helpers import REPO_ROOT
from tests.helpers.warm import APP, run_warm

ACCURACY = re.compile(r"final validation accuracy: ([0-9.]+)")


def test_checkpoint_monitors_the_exact_accuracy_when_sequential_evaluation_is_on():
    assert _accuracy_key(compose_config([])) == "val/exact_acc"
    assert _accuracy_key(compose_config(["callbacks=none"])) == "val/acc"


def test_a_sweep_job_leaves_no_environment_behind(monkeypatch):
    monkeypatch.setenv("KEPT", "user")
    before = dict(os.environ)
    monkeypatch.setenv("MASTER_PORT", "12345")  # set by the launcher during the job
    monkeypatch.setenv("NCCL_IB_TIMEOUT", "22")  # set by the job's network preset
    monkeypatch.setenv("KEPT", "changed")
    _reset_job_state(before)
    environ = os.environ
    assert "MASTER_PORT" not in environ and "NCCL_IB_TIMEOUT" not in environ
    assert environ["KEPT"] == "user"


# One error of each stage, through a fresh interpreter (`python -m`): a group choice Hydra refuses, what
# this machine cannot run, a wrong type the schema finds. tests/app/test_bad_input.py walks 60
# command lines through the same entry point, forked from one warm process.
@pytest.mark.parametrize(("argv", "message"), [BAD_INPUTS[0], BAD_INPUTS[6], BAD_INPUTS[8]])
def test_cli_bad_input_is_one_line_fast_and_writes_nothing(argv, message, tmp_path):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "ddp_plugins.train", *argv],
        cwd=tmp_path,
        env=loopback_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    assert lines[0].startswith(f"error: {message}"), lines[0]
    assert list(tmp_path.iterdir()) == [], "a failed start must not create a run folder"
    assert elapsed < 30, f"the error took {elapsed:.1f}s; it must come before any process starts"


def test_help_lists_the_groups(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "ddp_plugins.train", "--help"],
        cwd=tmp_path,
        env=loopback_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    for group in GROUPS:
        assert f"{group}:" in result.stdout, f"--help does not list the {group} group"


def _single_folder(root: Path, depth: int) -> Path:
    folders = [p for p in root.glob("/".join(["*"] * depth)) if p.is_dir()]
    assert len(folders) == 1, f"expected one run folder under {root}, found {folders}"
    return folders[0]


def _assert_run_outputs(folder: Path) -> None:
    assert (folder / "checkpoints" / "last.ckpt").is_file(), f"no checkpoint in {folder}"
    assert (folder / "metrics" / "metrics.csv").is_file(), f"no CSV metrics in {folder}"
    assert not list(folder.rglob("*.tmp")), "a temporary file was left behind"


@pytest.mark.slow
@pytest.mark.e2e
def test_make_train_job_reaches_095_with_one_run_folder(tmp_path):
    """The default job (what `make train` runs): 2 CPU ranks over gloo, accuracy >= 0.95."""
    result = check_ok(run_command(APP, timeout=300, cwd=tmp_path))
    accuracy = [float(a) for a in ACCURACY.findall(result.stdout)]
    assert len(accuracy) == 1, f"rank 0 alone prints the accuracy once:\n{result.stdout[-2000:]}"
    assert accuracy[0] >= 0.95
    assert "MEMBER: 2/2" in result.stdout + result.stderr, "the job did not run 2 processes"
    assert "Epoch" in result.stderr + result.stdout, "no progress bar"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    folder = _single_folder(tmp_path / "outputs", 2)
    _assert_run_outputs(folder)
    assert (folder / ".hydra" / "config.yaml").is_file()
    assert (folder / "train_rank1.log").is_file(), "rank 1 should log into the same run folder"


@pytest.mark.slow
def test_multirun_runs_each_job_once_as_a_two_process_ddp_run(tmp_path):
    cmd = [*APP, "-m", "precision=32-true,bf16-mixed", "data=synthetic", "data.num_samples=640", "model.channels=8",
           "trainer.max_epochs=1", "trainer.enable_progress_bar=false"]  # fmt: skip
    result = check_ok(run_warm(cmd, timeout=400, cwd=tmp_path))
    out = result.stdout + result.stderr
    assert len(ACCURACY.findall(result.stdout)) == 2, "expected one accuracy line per job"
    assert out.count("MEMBER: 2/2") == 2, "each job should start exactly one child rank"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun"], "no second multirun or outputs folder"
    sweep = _single_folder(tmp_path / "multirun", 2)
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"], f"expected two job folders, got {jobs}"
    for job, precision in zip(jobs, ["32-true", "bf16-mixed"], strict=True):
        folder = sweep / job
        _assert_run_outputs(folder)
        assert f"precision={precision}" in (folder / ".hydra" / "overrides.yaml").read_text()
        assert (folder / "train_rank1.log").is_file(), f"job {job}'s child rank wrote elsewhere"


@pytest.mark.slow
def test_child_ranks_use_the_config_the_user_chose(tmp_path):
    """--config-dir/--config-name reach the child rank: a different model there would break DDP."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "mine.yaml").write_text(
        "defaults:\n  - train\n  - _self_\nmodel:\n  channels: 8\ntrainer:\n  max_epochs: 1\n"
    )
    cmd = [*APP, "--config-dir", str(conf), "--config-name", "mine", "trainer.enable_progress_bar=false"]
    result = check_ok(run_warm(cmd, timeout=300, cwd=tmp_path))
    assert "MEMBER: 2/2" in result.stdout + result.stderr
    config = (_single_folder(tmp_path / "outputs", 2) / ".hydra" / "config.yaml").read_text()
    assert "channels: 8" in config and "max_epochs: 1" in config


# On one GPU (`make gpu-check`) the two nodes are this machine's one GPU twice: backend=auto picks gloo
# (with CUDA tensors), where nccl would fail with its "invalid usage".
@pytest.mark.parametrize(
    "gpu", [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.gpu)], ids=["cpu", "gpu"]
)
@pytest.mark.e2e
def test_two_torchrun_nodes_on_loopback(tmp_path, gpu):
    """2 nodes x 1 process, as on a cluster: one torchrun per node, Lightning's own path."""
    port = str(free_port())
    procs = []
    for node in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
            "--master-addr=127.0.0.1", f"--master-port={port}",
            "-m", "ddp_plugins.train",
            "trainer.devices=1", "trainer.num_nodes=2", "trainer.max_epochs=2",
            "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / f'node{node}'}",
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, cwd=tmp_path, env=loopback_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            proc.kill()
    for node, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{out[-4000:]}"
    assert "MEMBER: 1/2" in outputs[0] and "MEMBER: 2/2" in outputs[1]
    assert ("GPU available: True (cuda), used: True" in outputs[0]) is gpu, outputs[0][-4000:]
    assert ACCURACY.search(outputs[0]), "node 0 (global rank 0) prints the accuracy"
    assert not ACCURACY.search(outputs[1])
    _assert_run_outputs(tmp_path / "node0")


@pytest.mark.slow
@pytest.mark.e2e
def test_installed_wheel_finds_its_configs(tmp_path):
    """Build the wheel, install it outside the checkout and run the app from elsewhere."""
    wheel_dir, target, source = tmp_path / "wheel", tmp_path / "site", tmp_path / "src"
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    junk = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", "outputs", "multirun")
    shutil.copytree(REPO_ROOT, source, ignore=junk)
    pip = [sys.executable, "-m", "pip"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir), str(source)]
    check_ok(run_command(build, timeout=300))
    wheel = next(wheel_dir.glob("ddp_plugins-*.whl"))
    check_ok(run_command([*pip, "install", "--no-deps", "-q", "--target", str(target), str(wheel)], timeout=300))
    assert (target / "ddp_plugins" / "conf" / "train.yaml").is_file(), "configs not shipped in the wheel"
    env = loopback_env()
    env["PYTHONPATH"] = str(target)  # the installed copy, not the checkout
    code = "import ddp_plugins, sys; print(ddp_plugins.__file__)"
    where = check_ok(run_command([sys.executable, "-c", code], timeout=120, env=env, cwd=tmp_path)).stdout
    assert where.startswith(str(target)), f"imported {where} instead of the installed wheel"
    result = check_ok(run_command([*APP, "backend=gloo", "--cfg", "job"], timeout=120, env=env, cwd=tmp_path))
    assert "name: gloo" in result.stdout and "DigitsCNN" in result.stdout
    bad = run_command([*APP, "backend=foo"], timeout=120, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "error: backend got 'foo', allowed: one of" in bad.stderr
