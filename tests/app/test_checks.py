"""The app's Hydra configs and up-front checks: every option composes and instantiates, bad input fails fast.

The command line itself (exit code, one line on stderr, no run folder) is tested in
tests/app/test_train.py and tests/app/test_bad_input.py.
"""

import os
import re
from pathlib import Path

import pytest
from hydra.utils import instantiate
from lightning.pytorch import Trainer
from omegaconf import OmegaConf

from ddp_plugins.app import config
from ddp_plugins.app.checks import build_objects
from ddp_plugins.app.config import ConfigError, compose_config
from ddp_plugins.app.precheck import _check_devices, check_config, max_cpu_processes, precheck
from ddp_plugins.app.train import build_trainer
from ddp_plugins.lightning import tensorboard_logger
from ddp_plugins.lightning.strategy import DDPPluginsStrategy

GROUPS = ["backend", "precision", "strategy", "trainer", "data", "model", "callbacks", "network", "logger"]
# Options that cannot run on a CPU-only machine with the pip torch, and the error each must give.
CPU_ERRORS = {
    ("backend", "nccl"): "backend got 'nccl' without CUDA GPUs",
    ("backend", "mpi"): "backend got 'mpi' with a torch built without MPI",
    ("precision", "16-mixed"): "precision got '16-mixed', which needs CUDA",
}


def test_groups_and_their_options():
    assert {g: config.group_options(g) for g in ["backend", "precision", "strategy"]} == {
        "backend": ["auto", "gloo", "mpi", "nccl"],
        "precision": ["16-mixed", "32-true", "64-true", "auto", "bf16-mixed"],
        "strategy": ["ddp", "ddp_notebook", "ddp_spawn"],
    }
    for group in GROUPS:
        assert config.group_options(group), f"config group {group} has no options"


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in config.group_options(g)])
def test_every_option_composes_and_instantiates(group, option, tmp_path):
    cfg = compose_config([f"{group}={option}"])
    expected_error = CPU_ERRORS.get((group, option))
    if expected_error:
        with pytest.raises(ConfigError, match=f"^{re.escape(expected_error)}"):
            check_config(cfg)
        return
    check_config(cfg)
    objects = build_objects(cfg)
    assert isinstance(objects["trainer"], Trainer) and isinstance(objects["strategy"], DDPPluginsStrategy)
    trainer = build_trainer(cfg, tmp_path)
    assert isinstance(trainer, Trainer)
    assert isinstance(trainer.strategy, DDPPluginsStrategy)
    assert trainer.strategy._get_process_group_backend() == "gloo"  # auto on CPU
    assert trainer.precision == config.resolve_precision(cfg.precision.name, "cpu")
    instantiate(cfg.data).setup()
    instantiate(cfg.model)
    plugin_types = {type(cb).__name__ for cb in trainer.callbacks}
    for name in cfg.get("callbacks") or {}:
        assert type(instantiate(cfg.callbacks[name])).__name__ in plugin_types
    assert type(trainer.logger) is type(objects["logger"]) and trainer.logger.save_dir == str(tmp_path)
    assert Path(trainer.logger.log_dir).parent == tmp_path, "the logger writes into a fixed folder of the run"


def test_auto_choices_on_cpu():  # backend=auto on CPU: test_every_option_composes_and_instantiates
    assert config.resolve_precision("auto", "cpu") == "32-true"
    cfg = compose_config(["backend=gloo", "precision=bf16-mixed", "trainer.devices=2", "trainer.max_epochs=3"])
    got = (cfg.backend.name, cfg.precision.name, cfg.trainer.devices, cfg.trainer.max_epochs)
    assert got == ("gloo", "bf16-mixed", 2, 3)


def test_auto_precision_on_a_bf16_gpu_is_bf16_mixed_but_32_true_in_the_reproducible_mode(monkeypatch):
    """Seen on an H100: ``reproducible=true`` alone was refused there, as ``auto`` had picked bf16-mixed."""
    monkeypatch.setattr(config.torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert config.resolve_precision("auto", "gpu") == "bf16-mixed"
    assert config.resolve_precision("auto", "gpu", reproducible=True) == "32-true"
    assert config.resolve_precision("bf16-mixed", "gpu", reproducible=True) == "bf16-mixed"  # refused later


def test_class_count_follows_the_model_everywhere():
    cfg = compose_config(["data=synthetic", "model.num_classes=5"])
    assert cfg.data.num_classes == 5
    assert cfg.callbacks.sequential_evaluation.metrics.exact_acc.num_classes == 5


def test_config_selection_flags_pass_the_precheck():
    precheck(["--config-name", "train", "backend=gloo"])
    precheck(["-cn=train", "trainer.max_epochs=1"])
    with pytest.raises(ConfigError, match="^backend got 'foo', allowed: one of"):
        precheck(["--config-name", "train", "backend=foo"])


def test_callbacks_are_switchable():
    assert not compose_config(["callbacks=none"]).get("callbacks")
    assert list(compose_config(["callbacks=[sync_batchnorm,rank_aware_seed]"]).callbacks) == [
        "sync_batchnorm",
        "rank_aware_seed",
    ]
    assert "sync_batchnorm" not in compose_config(["~callbacks.sync_batchnorm"]).callbacks
    added = compose_config(["callbacks=[default,comm_timeline]"]).callbacks  # an option outside the defaults
    assert list(added) == [*compose_config([]).callbacks, "comm_timeline"]


BAD_INPUTS = [
    (["backend=foo"], "backend got 'foo', allowed: one of 'auto', 'gloo', 'mpi', 'nccl'"),
    (["backend=nccl"], "backend got 'nccl' without CUDA GPUs (cuda available: False, accelerator: 'auto'), allowed:"),
    (["backend=mpi"], "backend got 'mpi' with a torch built without MPI ("),
    (
        ["precision=16-mixed"],
        "precision got '16-mixed', which needs CUDA (float16 autocast with a GradScaler) on a CPU run,"
        " allowed: '32-true', 'bf16-mixed' or 'auto' on CPU",
    ),
    (["precision=fp8"], "precision got 'fp8', allowed: one of '16-mixed', '32-true', '64-true', 'auto', 'bf16-mixed'"),
    (["strategy=deepspeed"], "strategy got 'deepspeed', allowed: one of 'ddp', 'ddp_notebook', 'ddp_spawn'"),
    (
        ["trainer.devices=64"],
        f"trainer.devices got 64, more CPU processes than this machine runs well ({os.cpu_count()} cores),"
        f" allowed: 1 to {max_cpu_processes()}",
    ),
    (["trainer.devices=0"], "trainer.devices got 0, allowed: a positive integer or 'auto'"),
    (["trainer.max_epochs=abc"], "trainer.max_epochs got 'abc', allowed: Optional[int]"),
    (["data.batch_size=0"], "data.batch_size got 0, allowed: an integer >= 1"),
    (["seed=-1"], "seed got -1, allowed: an integer in [0, 4294967295]"),
    (
        ["global_batch_size=5000"],
        "global_batch_size got 5000, more than the 1438 training rows of the data (every epoch would be a single"
        " step), allowed: at most 1438, or more rows (data.*)",
    ),
    (["no_such_key=1"], "override was refused by Hydra: Could not override 'no_such_key'"),
    (["logger=foo"], "logger got 'foo', allowed: one of 'csv', 'tensorboard'"),
]


SCHEMA_ERRORS = [
    (["deterministic=maybe"], "deterministic got 'maybe', allowed: true or false"),
    (["seed=abc"], "seed got 'abc', allowed: an integer"),
    (["global_batch_size=abc"], "global_batch_size got 'abc', allowed: an integer or null"),
    (["checkpoint.keep=x"], "checkpoint.keep got 'x', allowed: an integer"),
    (["checkpoint=5"], "checkpoint got 5, allowed: a mapping of every_n_train_steps, keep"),
    (["resume=null"], "resume got None, allowed: 'auto', 'never' or the path of a checkpoint file"),
    (["weights_only=maybe"], "weights_only got 'maybe', allowed: true or false"),
    (["network.env=5"], "network.env got 5, allowed: a mapping of environment variable names to values"),
    (["seed=${oc.env:DDP_PLUGINS_NO_SUCH_VARIABLE,abc}"], "seed got 'abc', allowed: an integer"),  # resolved late
    (["+checkpoint.foo=1"], "checkpoint.foo is not a key of the app's config, allowed: 'every_n_train_steps', 'keep'"),
    (["+foo=1"], "foo is not a key of the app's config, allowed: 'backend', 'callbacks', 'checkpoint', 'data',"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS + SCHEMA_ERRORS)
def test_precheck_rejects_bad_input(argv, message):
    """SCHEMA_ERRORS: OmegaConf refuses a wrong type against ``TrainConfig``, and the app restates it
    on the error's ``full_key``; the others are the app's and the classes' own checks."""
    with pytest.raises(ConfigError) as err:
        precheck(argv)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value), "the error must be one line"
    assert str(err.value) == f"{err.value.key} {err.value.problem}, allowed: {err.value.allowed}"


def test_tensorboard_without_its_writer_package_is_one_line(monkeypatch):
    monkeypatch.setattr(tensorboard_logger, "writer_problem", lambda: "tensorboardX (or tensorboard) is not installed")
    with pytest.raises(ConfigError) as err:
        precheck(["logger=tensorboard"])
    assert str(err.value) == (
        "logger got 'tensorboard', but tensorboardX (or tensorboard) is not installed,"
        " allowed: 'csv', or 'tensorboard' after `pip install 'ddp_plugins[tensorboard]'`"
    )


def test_the_composed_config_is_typed_by_the_schema():
    cfg = compose_config(["seed=7", "deterministic=true", "checkpoint.keep=3"])
    assert OmegaConf.get_type(cfg) is config.TrainConfig
    assert (cfg.seed, cfg.deterministic, cfg.checkpoint.keep) == (7, True, 3)
    assert isinstance(build_objects(cfg)["strategy"], DDPPluginsStrategy)  # `_target_` nodes still instantiate


def test_weights_only_false_lets_the_resume_check_load_a_trusted_checkpoint(tmp_path):
    """A checkpoint of the user's own model, an ``nn.Module`` in its hyperparameters (issue 53): refused in
    one line by default, naming the class and the way through; ``weights_only=false`` resumes from it."""
    import torch

    path = tmp_path / "trusted.ckpt"
    hyper_parameters = {"net": torch.nn.Linear(2, 2), "split": OmegaConf.create([55_000, 5_000, 10_000])}
    torch.save({"state_dict": {}, "loops": {}, "global_step": 3, "hyper_parameters": hyper_parameters}, path)
    with pytest.raises(ConfigError) as err:
        precheck([f"resume={path}"])
    assert str(err.value).startswith(
        f"resume got '{path}' (does not load with weights_only=True: it holds torch.nn.modules.linear.Linear;"
        " weights_only=false loads it if you trust the file, or save plain types in the hyperparameters)"
    ), str(err.value)
    assert "\n" not in str(err.value), "the error must be one line"
    assert compose_config([]).weights_only is True, "weights-only by default"
    precheck([f"resume={path}", "weights_only=false"])


def test_multirun_sweep_values_are_checked_before_any_job():
    with pytest.raises(ConfigError, match="^backend got 'foo', allowed: one of"):
        precheck(["-m", "backend=gloo,foo"])
    with pytest.raises(ConfigError, match="^precision got '16-mixed', which needs CUDA"):
        precheck(["-m", "precision=32-true,16-mixed"])  # the second job of the sweep
    precheck(["-m", "precision=32-true,bf16-mixed"])  # valid sweep passes


def test_gpu_device_forms_are_checked_against_the_gpu_count(monkeypatch):
    """On CUDA Lightning also takes -1 and index lists; the count comes from torch (2 GPUs faked here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for ok in (1, 2, -1, [0, 1], [1]):
        _check_devices(ok, "gpu")
    for bad, message in (
        (3, "trainer.devices got 3, more GPUs than this machine has (2), allowed: 1 to 2"),
        ([0, 2], "trainer.devices got [0, 2], allowed: GPU indices between 0 and 1"),
        ([], "trainer.devices got [], allowed: GPU indices between 0 and 1"),
    ):
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
            _check_devices(bad, "gpu")


@pytest.mark.parametrize(
    ("gpus", "env", "expected"),
    [
        (0, {}, 2),  # make train on a laptop: 2 processes over gloo
        (1, {}, 1),  # one GPU: 1 rank on nccl
        (4, {}, 4),  # k GPUs: k ranks
        (4, {"LOCAL_WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": "r"}, 3),  # torchrun's processes per node
        (0, {"SLURM_NTASKS_PER_NODE": "5", "SLURM_STEP_ID": "0"}, 5),  # an srun step's tasks per node
        (0, {"SLURM_NTASKS_PER_NODE": "5"}, 2),  # a Slurm allocation, but not an srun step
    ],
)
def test_devices_auto_runs_on_any_machine(monkeypatch, gpus, env, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for key in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = compose_config([])
    assert cfg.trainer.devices == "auto", "the default is auto"
    assert config.trainer_args(cfg.trainer)["devices"] == expected
    assert config.trainer_args(compose_config(["trainer.devices=3"]).trainer)["devices"] == 3, "a number is kept"
    assert config.resolve_devices("auto", "cpu") == (
        expected if env.get("SLURM_STEP_ID") or "LOCAL_WORLD_SIZE" in env else 2
    )


REPRODUCIBLE = ["data=synthetic", "data.num_samples=400", "reproducible=true", "global_batch_size=50", "backend=gloo"]


def test_reproducible_on_cuda_without_deterministic_kernels_is_refused_up_front(monkeypatch):
    """On 2 GPUs (CUDA mocked), before Hydra makes a folder or any rank starts: ``deterministic`` names itself."""
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)  # whatever other tests left
    with pytest.raises(ConfigError) as refused:
        precheck(REPRODUCIBLE)
    assert str(refused.value) == (
        "deterministic got false, but reproducible=true on CUDA needs deterministic kernels (others change the bits),"
        " allowed: true with reproducible=true on CUDA, and callbacks.rank_aware_seed on"
    )
    with pytest.raises(ConfigError, match=r"^deterministic got true, but callbacks\.rank_aware_seed, which applies"):
        precheck([*REPRODUCIBLE, "deterministic=true", "~callbacks.rank_aware_seed"])
    precheck([*REPRODUCIBLE, "deterministic=true"])  # RankAwareSeed sets them in each rank's setup
    precheck(REPRODUCIBLE[:-3])  # the default mode does not need them
    precheck([*REPRODUCIBLE, "trainer.accelerator=cpu"])  # nor does the CPU


def test_shards_too_small_for_a_batchnorm1d_are_refused_up_front():
    """320 training rows in steps of 50: the last has 20, which 16 shards cut into shards of 1 row."""
    run = [*REPRODUCIBLE, "model.channels=8", "model._target_=tests.helpers.models.BatchNorm1dHeadCNN"]
    with pytest.raises(ConfigError) as refused:
        precheck([*run, "strategy.virtual_shards=16"])
    assert str(refused.value) == (
        "strategy.virtual_shards got 16: step 6 has 20 rows, which virtual_shards=16 cut into shards of 1 row,"
        " allowed: at most 10 with reproducible=True, as BatchNorm1d 'head.0' normalizes each virtual shard"
        " (2 rows or more)"
    )
    precheck([*run, "strategy.virtual_shards=10"])
    precheck([*run, "strategy.virtual_shards=16", "strategy.drop_last=true"])
    precheck([*REPRODUCIBLE, "strategy.virtual_shards=16"])  # the demo's BatchNorm2d normalizes rows x pixels
