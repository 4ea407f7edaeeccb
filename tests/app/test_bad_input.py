"""Bad command lines: each ends at once with one line ``error: <key> ..., allowed: ...`` and exit code 2.

No run folder, no process started, under 10 s, whatever was wrong: a group choice, a value a
class refuses, a key no class takes, what this machine cannot run, or one job of a sweep.
"""

import json
import sys

import pytest

from ddp_plugins.app.precheck import max_cpu_processes
from ddp_plugins.testing import check_ok, loopback_env, run_command
from tests.helpers.shared import made_once

# (command line, the config key the error must name)
BAD_COMMAND_LINES = [
    ("backend=foo", "backend"),
    ("backend=nccl", "backend"),
    ("backend=mpi", "backend"),
    ("precision=16-mixed", "precision"),
    ("precision=fp8", "precision"),
    ("strategy=deepspeed", "strategy"),
    ("callbacks=[sync_batchnorm,nope]", "callbacks"),
    (f"trainer.devices={max_cpu_processes() + 1}", "trainer.devices"),
    ("trainer.devices=0", "trainer.devices"),
    ("trainer.devices=[0]", "trainer.devices"),
    ("trainer.max_epochs=abc", "trainer.max_epochs"),
    ("trainer.accelerator=tpu", "trainer.accelerator"),
    ("trainer.num_nodes=0", "trainer.num_nodes"),
    ("+trainer.foo=1", "trainer.foo"),
    ("+trainer.limit_train_batches=2.5", "trainer.limit_train_batches"),
    ("+trainer.strategy=ddp", "trainer.strategy"),
    ("data.batch_size=0", "data.batch_size"),
    ("data.val_fraction=1.5", "data.val_fraction"),
    ("global_batch_size=1", "global_batch_size"),  # fewer rows than 2 ranks
    ("global_batch_size=5000", "global_batch_size"),  # more rows than the data's 1438
    ("data.num_workers=-1", "data.num_workers"),
    ("data=synthetic data.num_samples=0", "data.num_samples"),
    ("model.channels=0", "model.channels"),
    ("model.num_classes=1", "model.num_classes"),
    ("model.dropout=1.5", "model.dropout"),
    ("model.lr=nan", "model.lr"),
    ("model.lr=-1", "model.lr"),
    ("+model.foo=1", "model.foo"),
    ("model._target_=nope.Model", "model._target_"),
    ("strategy.timeout=inf", "strategy.timeout"),
    ("strategy.timeout=0", "strategy.timeout"),
    ("strategy.rendezvous_timeout=-5", "strategy.rendezvous_timeout"),
    ("strategy.start_method=foo", "strategy.start_method"),
    ("strategy.find_unused_parameters=maybe", "strategy.find_unused_parameters"),
    ("strategy.bucket_cap_mb=0", "strategy.bucket_cap_mb"),
    ("strategy.comm_hook=bf16", "strategy.comm_hook"),
    ("strategy.comm_hook=zip", "strategy.comm_hook"),
    ("strategy.powersgd_rank=0", "strategy.powersgd_rank"),
    ("deterministic=maybe", "deterministic"),
    ("global_batch_size=abc", "global_batch_size"),  # a wrong type for the schema (TrainConfig)
    ("checkpoint.keep=x", "checkpoint.keep"),
    ("+checkpoint.foo=1", "checkpoint.foo"),
    ("seed=-1", "seed"),
    ("seed=99999999999", "seed"),
    ("no_such_key=1", "override"),
    ("network.env=5", "network.env"),
    (
        "callbacks.accumulation_no_sync.accumulate_grad_batches=0",
        "callbacks.accumulation_no_sync.accumulate_grad_batches",
    ),
    ("callbacks.sync_batchnorm.group_size=3", "callbacks.sync_batchnorm.group_size"),
    ("callbacks.sync_batchnorm.skip_frozen=maybe", "callbacks.sync_batchnorm.skip_frozen"),
    ("callbacks.sync_batchnorm.extra_classes=[nope.Norm]", "callbacks.sync_batchnorm.extra_classes"),
    ("callbacks.sequential_evaluation.stages=[train]", "callbacks.sequential_evaluation.stages"),
    ("callbacks.allreduce_counter.prefix=''", "callbacks.allreduce_counter.prefix"),
    ("callbacks.rank_aware_seed.workers=3", "callbacks.rank_aware_seed.workers"),
    ("callbacks.preemption.check_every_n_steps=often", "callbacks.preemption.check_every_n_steps"),
    (
        "trainer.accumulate_grad_batches=4 callbacks.accumulation_no_sync.accumulate_grad_batches=2",
        "callbacks.accumulation_no_sync.accumulate_grad_batches",
    ),
    ("-m precision=32-true,16-mixed", "precision"),  # the second job of the sweep
    ("-m model.lr=0.1,0.01,-3", "model.lr"),  # the third
    ("-m trainer.max_epochs=1 data.batch_size=8,0", "data.batch_size"),
    # a submitit sweep whose Slurm tasks are not the trainer's processes (checked before sbatch)
    ("-m hydra/launcher=submitit_slurm trainer.devices=2 model.lr=0.1,0.01", "hydra.launcher.tasks_per_node"),
    ("-m hydra/launcher=submitit_slurm hydra.launcher.tasks_per_node=two", "hydra.launcher.tasks_per_node"),
    ("-m hydra/launcher=submitit_slurm hydra.launcher.tasks_per_node=2 trainer.num_nodes=1,2", "hydra.launcher.nodes"),
]


@pytest.fixture(scope="session")
def walked(tmp_path_factory):
    lines = json.dumps([line.split() for line, _ in BAD_COMMAND_LINES])

    def make(shared):
        cmd = [sys.executable, "-m", "tests.helpers.bad_cli", str(shared / "results.json"), lines]
        check_ok(run_command(cmd, timeout=600, env=loopback_env()))

    out = made_once(tmp_path_factory, "bad_command_lines", make) / "results.json"
    return {" ".join(r["argv"]): r for r in json.loads(out.read_text())}


def test_at_least_forty_bad_command_lines():
    assert len(BAD_COMMAND_LINES) >= 40


@pytest.mark.parametrize(("line", "key"), BAD_COMMAND_LINES, ids=[line for line, _ in BAD_COMMAND_LINES])
def test_bad_command_line_fails_at_once_with_one_line(walked, line, key):
    result = walked[line]
    assert result["code"] == 2, f"exit code {result['code']}, expected 2\n{result['stderr'][-3000:]}"
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1, f"expected exactly one stderr line, got:\n{result['stderr'][-3000:]}"
    assert lines[0].startswith(f"error: {key} "), f"the error should name `{key}` first: {lines[0]}"
    assert ", allowed: " in lines[0], f"the error should say what is allowed: {lines[0]}"
    assert result["files"] == [], f"a refused start must write nothing, found {result['files']}"
    assert result["left_behind"] == [], "a refused start must start no process"
    assert result["seconds"] < 10, f"the error took {result['seconds']:.1f}s"


def test_a_good_sweep_passes_the_check_and_a_bad_one_names_its_job():
    from ddp_plugins.app.config import ConfigError
    from ddp_plugins.app.precheck import precheck

    precheck(["-m", "precision=32-true,bf16-mixed", "model.lr=0.1,0.01"])  # every job fine: no error
    with pytest.raises(ConfigError, match=r"^model\.lr got -3, allowed: a positive finite number$"):
        precheck(["-m", "model.lr=0.1,-3"])
    precheck(["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=2", "model.lr=0.1,0.01"])
    with pytest.raises(ConfigError, match=r"^hydra\.launcher\.tasks_per_node got 2, but trainer\.devices is 1, "):
        precheck(["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=2", "trainer.devices=1"])


def test_a_world_size_that_the_trainer_does_not_match_names_the_trainer_key(monkeypatch):
    """Under torchrun the check of devices x num_nodes names ``trainer.devices``; a Slurm environment
    that Lightning refuses whatever the arguments is the environment's fault, not ``trainer.accelerator``'s."""
    from ddp_plugins.app.config import ConfigError
    from ddp_plugins.app.precheck import precheck

    torchrun = {"TORCHELASTIC_RUN_ID": "t", "WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0",
                "LOCAL_WORLD_SIZE": "3", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}  # fmt: skip
    torchrun["MASTER_PORT"] = "29500"
    with monkeypatch.context() as env:
        for key, value in torchrun.items():
            env.setenv(key, value)
        with pytest.raises(ConfigError, match=r"^trainer\.devices .*\(3\)"):
            precheck(["trainer.devices=2"])
    slurm = {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "job", "SLURM_JOB_ID": "1",
             "SLURM_NODELIST": "localhost", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}  # fmt: skip
    with monkeypatch.context() as env:
        for key, value in slurm.items():
            env.setenv(key, value)
        with pytest.raises(ConfigError) as refused:
            precheck(["trainer.devices=2"])
    assert not str(refused.value).startswith("trainer.accelerator"), refused.value
