"""The DDP strategy: hooks by name on gloo through the Trainer, DDP options, SyncBN, no hangs on failure."""

import datetime
import os
import pickle
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from ddp_plugins.core.sync_batchnorm import SyncBatchNorm
from ddp_plugins.lightning.allreduce_counter import AllReduceCounter
from ddp_plugins.lightning.layer_sync import SyncBatchNormPlugin
from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from ddp_plugins.testing import free_port, loopback_env, run_command, run_lightning
from tests.helpers.warm import run_warm

# ---------------------------------------------------------------- arguments, registry, SyncBN


def test_registered_names_select_the_strategy_with_their_start_method():
    for name, method in (("ddp_plugins", "popen"), ("ddp_plugins_spawn", "spawn"), ("ddp_plugins_notebook", "fork")):
        assert name in StrategyRegistry
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        assert isinstance(trainer.strategy, DDPPluginsStrategy) and trainer.strategy._start_method == method


BF16_ON_GLOO = (
    "`comm_hook` should be 'none', 'fp16' or 'powersgd' (any backend), or 'bf16' with the nccl backend and"
    " NCCL 2.10+, got 'bf16' with the gloo backend."
)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"comm_hook": "fp8"},
            ValueError,
            "`comm_hook` should be one of 'none', 'fp16', 'bf16', 'powersgd', got 'fp8'.",
        ),
        ({"comm_hook": "bf16", "backend": "gloo"}, ValueError, BF16_ON_GLOO),
        ({"powersgd_rank": 0}, ValueError, "`powersgd_rank` should be an integer >= 1, got 0."),
        ({"powersgd_start_iter": 1}, ValueError, "`powersgd_start_iter` should be an integer >= 2, got 1."),
        (
            {"bucket_cap_mb": -1},
            ValueError,
            "`bucket_cap_mb` should be a positive finite number of MiB or None, got -1.",
        ),
        ({"static_graph": "yes"}, TypeError, "`static_graph` should be True or False, got 'yes'."),
        (
            {"timeout": 0},
            ValueError,
            "`timeout` should be a positive finite number of seconds (or a datetime.timedelta), got 0.",
        ),
        (
            {"rendezvous_timeout": -1},
            ValueError,
            "`rendezvous_timeout` should be a positive finite number of seconds (or a datetime.timedelta) or None",
        ),
        (
            {"process_group_backend": "ucc", "rendezvous_timeout": 60},
            ValueError,
            "`rendezvous_timeout` should be None or `timeout` on this backend, got 60. torch changes a 'ucc' group's",
        ),
        ({"backend": "foo"}, ValueError, "`backend` should be one of 'auto', 'gloo', 'nccl', 'mpi', got 'foo'."),
        (
            {"start_method": "x"},
            ValueError,
            "`start_method` should be one of 'popen', 'spawn', 'fork', 'forkserver', got 'x'.",
        ),
        (
            {"comm_hook": "fp16", "ddp_comm_hook": print},
            ValueError,
            "`comm_hook` should be 'none' when `ddp_comm_hook` is given, got 'fp16'.",
        ),
    ],
)
def test_bad_arguments_fail_at_once_naming_the_argument(kwargs, error, message):
    with pytest.raises(error) as err:
        DDPPluginsStrategy(**kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_bf16_on_cpu_is_refused_before_any_process_starts():
    with pytest.raises(ValueError) as err:
        pl.Trainer(accelerator="cpu", devices=2, strategy=DDPPluginsStrategy(comm_hook="bf16"), logger=False)
    assert str(err.value) == BF16_ON_GLOO


def test_sync_batchnorm_flag_installs_the_device_agnostic_plugin():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_plugins", sync_batchnorm=True, logger=False)
    assert isinstance(trainer.strategy._layer_sync, SyncBatchNormPlugin)
    plain = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_plugins", logger=False)
    assert plain.strategy._layer_sync is None
    given = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_plugins", plugins=[TorchSyncBatchNorm()], logger=False
    )
    assert isinstance(given.strategy._layer_sync, SyncBatchNormPlugin), "torch's plugin has a drop-in"

    class TorchsOwn(TorchSyncBatchNorm):
        pass

    kept = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_plugins", plugins=[TorchsOwn()], logger=False)
    assert type(kept.strategy._layer_sync) is TorchsOwn, "a subclass is how to keep torch's class"


class _BNModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(128, 16, generator=g), torch.randint(0, 4, (128,), generator=g)
        data = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(data, batch_size=8)


class _Probe(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        ddp = trainer.strategy.model
        self.seen = {
            "hooks": [hook.__qualname__ for hook, _ in ddp._comm_hooks],
            "bucket_bytes_cap": ddp.bucket_bytes_cap,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "find_unused_parameters": ddp.find_unused_parameters,
            "sync_bn": isinstance(pl_module.net[1], SyncBatchNorm),
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "debug": os.environ.get("TORCH_DISTRIBUTED_DEBUG"),
            "timeout": trainer.strategy._timeout,
        }


def _fit_each_hook(out_dir):
    os.environ.pop("GLOO_SOCKET_IFNAME", None)  # the strategy pins gloo to loopback itself
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # DDP on gloo segfaults with it: INFO during fit
    results = {}
    for name in ("none", "fp16", "powersgd"):
        pl.seed_everything(0, verbose=False)
        model, counter, probe = _BNModel(), AllReduceCounter(log=False), _Probe()
        strategy = DDPPluginsStrategy(
            backend="gloo",
            timeout=45,
            comm_hook=name,
            powersgd_start_iter=2,
            bucket_cap_mb=1,
            gradient_as_bucket_view=True,
            find_unused_parameters=True,
        )
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=6,
            sync_batchnorm=True,
            callbacks=[counter, probe],
            enable_progress_bar=False,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
        numel = sum(p.numel() for p in model.parameters())
        results[name] = {
            **probe.seen,
            "history": counter.history,
            "numel": numel,
            "gloo_ifname_after_fit": os.environ.get("GLOO_SOCKET_IFNAME"),
            "debug_after_fit": os.environ.get("TORCH_DISTRIBUTED_DEBUG"),
            "finite": all(torch.isfinite(p).all().item() for p in model.parameters()),
        }
    return results


@pytest.mark.slow
def test_each_hook_trains_through_the_trainer_and_fp16_halves_the_bytes():
    ranks = run_lightning(_fit_each_hook, timeout=240)
    for results in ranks:
        none, fp16, psgd = results["none"], results["fp16"], results["powersgd"]
        assert none["hooks"] == ["CountingCommHook(allreduce_hook)"], "the counter composes with the default"
        assert fp16["hooks"] == ["CountingCommHook(fp16_compress_hook)"], "fp16 registered on CPU, counted"
        assert psgd["hooks"] == ["CountingCommHook(_powersgd_hook)"], "PowerSGD registered on CPU, counted"
        for result in results.values():
            assert result["finite"]
            assert result["sync_bn"], "sync_batchnorm=True did not convert to the device-agnostic SyncBatchNorm"
            assert result["bucket_bytes_cap"] == 1024 * 1024 and result["gradient_as_bucket_view"]
            assert result["find_unused_parameters"]
            assert result["gloo_ifname"] == "lo", "gloo not pinned to loopback on a single node"
            assert result["gloo_ifname_after_fit"] is None, "the strategy left GLOO_SOCKET_IFNAME set after fit"
            assert (result["debug"], result["debug_after_fit"]) == ("INFO", "DETAIL"), "the user's debug level back"
            assert result["timeout"] == datetime.timedelta(seconds=45)
        # every optimizer step sends every parameter once: 4 bytes each without a hook, 2 with fp16
        assert [b for _, b, _ in none["history"]] == [4 * none["numel"]] * 6, none["history"]
        assert [b for _, b, _ in fp16["history"]] == [2 * none["numel"]] * 6, fp16["history"]
        assert [c for c, _, _ in fp16["history"]] == [c for c, _, _ in none["history"]]
        # PowerSGD: plain all-reduce for 2 steps, then much less counted by the hook itself
        psgd_bytes = [b for _, b, _ in psgd["history"]]
        assert psgd_bytes[:2] == [4 * none["numel"]] * 2 and max(psgd_bytes[2:]) < none["numel"], psgd_bytes


# ---------------------------------------------------------------- no hangs when a rank fails

FAIL_TIMEOUT = 20  # the strategy's collective timeout in the failure runs, seconds
HANG_TIMEOUT = 6  # ... in the hang runs: it starts once the ranks have met (rendezvous_timeout=120)


class _FailingDataset(torch.utils.data.Dataset):
    def __init__(self, fail):
        self.fail = fail

    def __len__(self):
        return 256

    def __getitem__(self, index):
        if self.fail and index >= 40:
            raise ValueError(f"boom in a dataloader worker of rank {self.fail[1]}")
        g = torch.Generator().manual_seed(index)
        return torch.randn(16, generator=g), index % 4


class _FailingModel(_BNModel):
    def __init__(self, mode, rank):
        super().__init__()
        self.mode, self.fail_rank = mode, rank

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and batch_idx == 3:
            if self.mode == "raise":
                raise RuntimeError(f"boom in training_step of rank {self.global_rank}")
            if self.mode == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "hang":  # stops progressing, neither raising nor dying
                time.sleep(10 * HANG_TIMEOUT)
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        fail = ("loader", self.fail_rank) if self.mode == "loader" and self.global_rank == self.fail_rank else None
        return torch.utils.data.DataLoader(_FailingDataset(fail), batch_size=4, num_workers=1 if fail else 0)


def _fit_and_fail(out_dir, mode, rank):  # the run's folder: out_dir (stall.txt, a rescue checkpoint)
    timeout = HANG_TIMEOUT if mode == "hang" else FAIL_TIMEOUT
    if mode == "hang" and rank == 1 and os.environ.get("LOCAL_RANK") == "1":
        time.sleep(HANG_TIMEOUT + 3)  # late to the rendezvous, by more than the collective timeout
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPPluginsStrategy(backend="gloo", timeout=timeout, rendezvous_timeout=120),
        max_epochs=1,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=out_dir,
    )
    trainer.fit(_FailingModel(mode, rank))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "rank", "message"),
    [
        ("raise", 1, "RuntimeError: boom in training_step of rank 1"),
        ("raise", 0, "RuntimeError: boom in training_step of rank 0"),
        ("loader", 1, "ValueError: boom in a dataloader worker of rank 1"),
        ("sigkill", 1, "its process is gone (killed or exited)"),  # seen in /proc, or by the collective that failed
        ("sigkill", 0, "its process is gone (killed or exited)"),
    ],
)
def test_a_failing_rank_ends_every_process_non_zero_within_the_timeout(mode, rank, message):
    _check_failed_run(mode, rank, message)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(
    ("rank", "message"),
    [
        (1, "while the other ranks wait for it; a collective failed waiting for it (RuntimeError: "),
        (0, "while the other ranks wait for it; a collective failed waiting for it (RuntimeError: "),
    ],
)
def test_a_rank_that_stops_progressing_is_named_not_the_one_that_waited(rank, message):
    """A rank that hangs (neither raises nor dies): the other fails at the timeout, and its liveness
    room names the rank that never came, not itself, and ends the job.

    The collective timeout (6 s) starts once the ranks have met: rank 1 of the first case comes
    to the rendezvous 9 s late (``rendezvous_timeout=120``), and the run still trains to its hang."""
    _check_failed_run("hang", rank, message)


def _check_failed_run(mode, rank, message):
    with tempfile.TemporaryDirectory(prefix="ddp_plugins_fail_") as out_dir:
        (Path(out_dir) / "args.pkl").write_bytes(pickle.dumps((mode, rank)))
        cmd = [sys.executable, "-m", "tests.helpers.launch", f"{__name__}:_fit_and_fail", out_dir]
        start = time.monotonic()
        # every rank and dataloader worker holds the output: run_warm returns once all are gone
        bound = 11 * HANG_TIMEOUT if mode == "hang" else FAIL_TIMEOUT + 30
        result = run_warm(cmd, bound + 30, env=loopback_env(MASTER_PORT=str(free_port())))
        elapsed = time.monotonic() - start
    assert result.returncode != 0, f"exit code 0 after {mode} on rank {rank}\n{result.stderr[-3000:]}"
    # a hang: 66 s, before the hung rank's 60 s sleep, begun 9 s late, would end (69 s): the room ended it,
    # not the rank waking up (52 s measured in make test-e2e's 3 workers beside the zoo's 8 ranks)
    assert elapsed < bound, f"{elapsed:.0f} s, bound {bound} s\n{result.stderr[-3000:]}"
    if mode == "hang":  # the ranks met, though one came later than the collective timeout
        assert "did not all meet" not in result.stderr, result.stderr[-4000:]
    else:  # a failure, not a hang: every process ends without waiting out the timeout
        assert elapsed < FAIL_TIMEOUT + 15, f"{elapsed:.0f} s: a rank waited out the {FAIL_TIMEOUT} s timeout"
    assert message in result.stderr, f"{message!r} not shown:\n{result.stderr[-4000:]}"
    if mode in ("sigkill", "hang"):  # named in one line by a rank that waited for it, with no traceback
        assert re.search(rf"^error: rank {rank} \(PID \d+ on ", result.stderr, re.M), result.stderr[-4000:]
        assert "Traceback" not in result.stderr, result.stderr[-4000:]


_KILLED_RANK = """
import multiprocessing, os, signal, sys
import torch

out = sys.argv[1]

def note_pid(worker_id):
    open(os.path.join(out, f"worker-{os.getpid()}"), "w").close()

def main():  # Lightning imported here: each loader worker runs this file again, as __mp_main__
    import lightning.pytorch as pl
    from ddp_plugins.lightning.strategy import DDPPluginsStrategy

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a torchrun restart would
            return self.lin(batch[0]).sum()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(64, 2))
            return torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True,
                worker_init_fn=note_pid, multiprocessing_context=multiprocessing.get_context("forkserver"))

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DDPPluginsStrategy(backend="gloo"), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net())

if __name__ == "__main__":
    main()
"""


@pytest.mark.e2e
def test_forkserver_workers_of_a_killed_rank_leave_instead_of_holding_its_pipes_forever(tmp_path):
    # torch's workers watch their parent, which is the forkserver here: without the strategy's
    # rank watch they and the forkserver outlive the rank and keep its stdout open (a test or a
    # Slurm step waiting for EOF hangs)
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_RANK)
    start = time.monotonic()
    result = run_command([sys.executable, str(script), str(tmp_path)], timeout=120, env=loopback_env())
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    workers = [int(p.name.split("-")[1]) for p in tmp_path.glob("worker-*")]
    assert len(workers) == 2, sorted(p.name for p in tmp_path.iterdir())
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    for pid in alive:  # ours: started by this test's script
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their killed rank"
    assert time.monotonic() - start < 100


_SIGNALED_HELPERS = """
import multiprocessing, os, signal
from multiprocessing import forkserver, resource_tracker
import torch

def main():  # Lightning imported here: each loader worker runs this file again, as __mp_main__
    import lightning.pytorch as pl
    from ddp_plugins.lightning.strategy import DDPPluginsStrategy

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)
        def training_step(self, batch, batch_idx):
            if self.current_epoch == 0 and batch_idx == 1:  # what Slurm does to every process of the step
                helpers = [forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid]
                for pid in helpers:
                    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
                        os.kill(pid, sig)
                print("signalled", helpers, flush=True)
            return self.lin(batch[0]).sum()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
        def train_dataloader(self):  # workers forked anew every epoch, by the forkserver
            data = torch.utils.data.TensorDataset(torch.randn(16, 2))
            return torch.utils.data.DataLoader(data, batch_size=4, num_workers=2,
                multiprocessing_context=multiprocessing.get_context("forkserver"))

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DDPPluginsStrategy(backend="gloo"), max_epochs=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net())
    print("steps", trainer.global_step)

if __name__ == "__main__":
    main()
"""


@pytest.mark.e2e
def test_the_forkserver_and_resource_tracker_survive_the_stop_signals_a_job_step_gets(tmp_path):
    script = tmp_path / "signalled.py"
    script.write_text(_SIGNALED_HELPERS)
    result = run_command([sys.executable, str(script)], timeout=120, env=loopback_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "signalled" in result.stdout and "steps 8" in result.stdout, result.stdout[-2000:]
    assert "died unexpectedly" not in result.stderr, result.stderr[-3000:]
