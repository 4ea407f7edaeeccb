"""The app's Hydra configs and checks: every option composes and instantiates, bad input fails fast."""

import subprocess
import sys
import time

import pytest
from hydra.utils import instantiate
from lightning.pytorch import Trainer

from ddp_plugins import config as checks
from ddp_plugins.strategy import DDPPluginsStrategy
from ddp_plugins.train import build_trainer, compose_config, precheck
from tests.helpers.multiprocess import loopback_env

GROUPS = ["backend", "precision", "strategy", "trainer", "data", "model", "callbacks", "network"]
# Options that cannot run on a CPU-only machine with the pip torch, and the error each must give.
CPU_ERRORS = {
    ("backend", "nccl"): "needs CUDA",
    ("backend", "mpi"): "needs a torch built with MPI",
    ("precision", "16-mixed"): "needs CUDA",
}


def test_groups_and_their_options():
    assert {g: checks.group_options(g) for g in ["backend", "precision", "strategy"]} == {
        "backend": ["auto", "gloo", "mpi", "nccl"],
        "precision": ["16-mixed", "32-true", "auto", "bf16-mixed"],
        "strategy": ["ddp", "ddp_notebook", "ddp_spawn"],
    }
    for group in GROUPS:
        assert checks.group_options(group), f"config group {group} has no options"


@pytest.mark.parametrize(
    ("group", "option"), [(g, o) for g in GROUPS for o in checks.group_options(g)]
)
def test_every_option_composes_and_instantiates(group, option, tmp_path):
    cfg = compose_config([f"{group}={option}"])
    expected_error = CPU_ERRORS.get((group, option))
    if expected_error:
        with pytest.raises(checks.ConfigError, match=expected_error):
            build_trainer(cfg, tmp_path)
        return
    trainer = build_trainer(cfg, tmp_path)
    assert isinstance(trainer, Trainer)
    assert isinstance(trainer.strategy, DDPPluginsStrategy)
    assert trainer.strategy._get_process_group_backend() == "gloo"  # auto on CPU
    assert trainer.precision == checks.resolve_precision(cfg.precision.name, "cpu")
    instantiate(cfg.data).setup()
    instantiate(cfg.model)
    plugin_types = {type(cb).__name__ for cb in trainer.callbacks}
    for name in (cfg.get("callbacks") or {}):
        assert type(instantiate(cfg.callbacks[name])).__name__ in plugin_types


def test_auto_choices_on_cpu():
    assert checks.resolve_backend("auto", "cpu") == "gloo"
    assert checks.resolve_precision("auto", "cpu") == "32-true"
    cfg = compose_config(["backend=gloo", "precision=bf16-mixed", "trainer.devices=2", "trainer.max_epochs=3"])
    assert (cfg.backend.name, cfg.precision.name, cfg.trainer.devices, cfg.trainer.max_epochs) == (
        "gloo",
        "bf16-mixed",
        2,
        3,
    )


def test_class_count_follows_the_model_everywhere():
    cfg = compose_config(["data=synthetic", "model.num_classes=5"])
    assert cfg.data.num_classes == 5
    assert cfg.callbacks.sequential_evaluation.metrics.exact_acc.num_classes == 5


def test_checkpoint_monitors_the_exact_accuracy_when_sequential_evaluation_is_on():
    from ddp_plugins.train import _accuracy_key

    assert _accuracy_key(compose_config([])) == "val/exact_acc"
    assert _accuracy_key(compose_config(["callbacks=none"])) == "val/acc"


def test_a_sweep_job_leaves_no_environment_behind(monkeypatch):
    from ddp_plugins.train import _reset_job_state

    monkeypatch.setenv("KEPT", "user")
    before = dict(__import__("os").environ)
    monkeypatch.setenv("MASTER_PORT", "12345")  # set by the launcher during the job
    monkeypatch.setenv("NCCL_IB_TIMEOUT", "22")  # set by the job's network preset
    monkeypatch.setenv("KEPT", "changed")
    _reset_job_state(before)
    environ = __import__("os").environ
    assert "MASTER_PORT" not in environ and "NCCL_IB_TIMEOUT" not in environ
    assert environ["KEPT"] == "user"


def test_config_selection_flags_pass_the_precheck():
    precheck(["--config-name", "train", "backend=gloo"])
    precheck(["-cn=train", "trainer.max_epochs=1"])
    with pytest.raises(checks.ConfigError, match="got 'foo'"):
        precheck(["--config-name", "train", "backend=foo"])


def test_callbacks_are_switchable():
    assert not compose_config(["callbacks=none"]).get("callbacks")
    assert list(compose_config(["callbacks=[sync_batchnorm,rank_aware_seed]"]).callbacks) == [
        "sync_batchnorm",
        "rank_aware_seed",
    ]
    assert "sync_batchnorm" not in compose_config(["~callbacks.sync_batchnorm"]).callbacks


BAD_INPUTS = [
    (["backend=foo"], "`backend` should be one of 'auto', 'gloo', 'mpi', 'nccl', got 'foo'"),
    (["backend=nccl"], "`backend=nccl` needs CUDA"),
    (["backend=mpi"], "`backend=mpi` needs a torch built with MPI"),
    (["precision=16-mixed"], "`precision=16-mixed` needs CUDA"),
    (["precision=fp8"], "`precision` should be one of"),
    (["strategy=deepspeed"], "`strategy` should be one of 'ddp', 'ddp_notebook', 'ddp_spawn'"),
    (["trainer.devices=64"], f"at most {checks.max_cpu_processes()}"),
    (["trainer.devices=0"], "`trainer.devices` should be a positive integer"),
    (["trainer.max_epochs=abc"], "`trainer.max_epochs` should be an integer >= -1, got 'abc'"),
    (["data.batch_size=0"], "`data.batch_size` should be >= 1, got 0"),
    (["seed=-1"], "`seed` should be"),
    (["no_such_key=1"], "bad override: Could not override 'no_such_key'"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS)
def test_precheck_rejects_bad_input(argv, message):
    with pytest.raises(checks.ConfigError) as err:
        precheck(argv)
    assert message in str(err.value)
    assert "\n" not in str(err.value), "the error must be one line"


def test_multirun_sweep_values_are_checked_before_any_job():
    with pytest.raises(checks.ConfigError, match="got 'foo'"):
        precheck(["-m", "backend=gloo,foo"])
    precheck(["-m", "precision=32-true,bf16-mixed"])  # valid sweep passes


@pytest.mark.parametrize(
    ("argv", "message"),
    [BAD_INPUTS[0], BAD_INPUTS[2], BAD_INPUTS[3], BAD_INPUTS[6], BAD_INPUTS[8], BAD_INPUTS[1]],
)
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
    assert lines[0].startswith("error: ") and message in lines[0]
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


def test_gpu_device_forms_are_checked_against_the_gpu_count(monkeypatch):
    """On CUDA Lightning also takes -1 and index lists; the count comes from torch (2 GPUs faked here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for ok in (1, 2, -1, [0, 1], [1]):
        checks.validate({"trainer": {"devices": ok, "accelerator": "gpu"}})
    for bad, message in ((3, "more GPUs than this machine has (2)"), ([0, 2], "between 0 and 1"), ([], "between 0 and 1")):
        with pytest.raises(checks.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            checks.validate({"trainer": {"devices": bad, "accelerator": "gpu"}})
