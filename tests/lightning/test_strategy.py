"""The DDP strategy: hooks by name on gloo, DDP options, SyncBN, network presets, no hangs on failure."""

import datetime
import io
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
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_plugins import AllReduceCounter, SyncBatchNorm, SyncBatchNormPlugin, setup_rank_logging
from ddp_plugins.strategy import DDPPluginsStrategy, apply_network_env, build_comm_hook
from tests.helpers.multiprocess import free_port, loopback_env, run_command, run_lightning

# ---------------------------------------------------------------- arguments, registry, SyncBN


def test_registered_names_select_the_strategy_with_their_start_method():
    for name, method in (("ddp_plugins", "popen"), ("ddp_plugins_spawn", "spawn"), ("ddp_plugins_notebook", "fork")):
        assert name in StrategyRegistry
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        assert isinstance(trainer.strategy, DDPPluginsStrategy) and trainer.strategy._start_method == method


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"comm_hook": "fp8"}, "`comm_hook` should be one of 'none', 'fp16', 'bf16', 'powersgd', got 'fp8'."),
        ({"comm_hook": "bf16", "backend": "gloo"}, "`comm_hook='bf16'` needs the nccl backend"),
        ({"powersgd_rank": 0}, "`powersgd_rank` should be an integer >= 1, got 0."),
        ({"powersgd_start_iter": 1}, "`powersgd_start_iter` should be an integer >= 2, got 1."),
        ({"bucket_cap_mb": -1}, "`bucket_cap_mb` should be a positive number of MiB or None, got -1."),
        ({"static_graph": "yes"}, "`static_graph` should be True or False, got 'yes'."),
        ({"timeout": 0}, "`timeout` should be a positive number of seconds, got 0."),
        ({"comm_hook": "fp16", "ddp_comm_hook": print}, "both set the hook"),
    ],
)
def test_bad_arguments_fail_at_once_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError) as err:
        DDPPluginsStrategy(**kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bf16_on_cpu_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"`comm_hook='bf16'` needs the nccl backend .* got the gloo backend"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=DDPPluginsStrategy(comm_hook="bf16"), logger=False)


def test_sync_batchnorm_flag_installs_the_device_agnostic_plugin():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_plugins", sync_batchnorm=True, logger=False)
    assert isinstance(trainer.strategy._layer_sync, SyncBatchNormPlugin)
    plain = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_plugins", logger=False)
    assert plain.strategy._layer_sync is None


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
        data = torch.utils.data.TensorDataset(torch.randn(128, 16, generator=g), torch.randint(0, 4, (128,), generator=g))
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
            "timeout": trainer.strategy._timeout,
        }


def _fit_each_hook(out_dir):
    os.environ.pop("GLOO_SOCKET_IFNAME", None)  # the strategy pins gloo to loopback itself
    results = {}
    for name in ("none", "fp16", "powersgd"):
        pl.seed_everything(0, verbose=False)
        model, counter, probe = _BNModel(), AllReduceCounter(log=False), _Probe()
        strategy = DDPPluginsStrategy(
            backend="gloo", timeout=45, comm_hook=name, powersgd_start_iter=2, bucket_cap_mb=1,
            gradient_as_bucket_view=True, find_unused_parameters=True,
        )
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=6, sync_batchnorm=True,
            callbacks=[counter, probe], enable_progress_bar=False, logger=False,
            enable_checkpointing=False, enable_model_summary=False,
        )
        trainer.fit(model)
        numel = sum(p.numel() for p in model.parameters())
        results[name] = {**probe.seen, "history": counter.history, "numel": numel,
                         "finite": all(torch.isfinite(p).all().item() for p in model.parameters())}
    return results


@pytest.mark.slow
def test_each_hook_trains_through_the_trainer_and_fp16_halves_the_bytes():
    ranks = run_lightning(_fit_each_hook, timeout=240)
    for rank, results in enumerate(ranks):
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
            assert result["timeout"] == datetime.timedelta(seconds=45)
        # every optimizer step sends every parameter once: 4 bytes each without a hook, 2 with fp16
        assert [b for _, b, _ in none["history"]] == [4 * none["numel"]] * 6, none["history"]
        assert [b for _, b, _ in fp16["history"]] == [2 * none["numel"]] * 6, fp16["history"]
        assert [c for c, _, _ in fp16["history"]] == [c for c, _, _ in none["history"]]
        # PowerSGD: plain all-reduce for 2 steps, then much less counted by the hook itself
        psgd_bytes = [b for _, b, _ in psgd["history"]]
        assert psgd_bytes[:2] == [4 * none["numel"]] * 2 and max(psgd_bytes[2:]) < none["numel"], psgd_bytes


# ---------------------------------------------------------------- network presets and rank logging

DOCUMENTED = {
    "default": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
    "infiniband": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_IB_TIMEOUT": "22", "NCCL_IB_RETRY_CNT": "7"},
    "tcp": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"},
    "debug": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "NCCL_DEBUG": "INFO"},
}
_ALL_PRESET_KEYS = sorted({key for env in DOCUMENTED.values() for key in env})


@pytest.mark.parametrize("preset", sorted(DOCUMENTED))
def test_network_preset_sets_exactly_its_variables_and_keeps_the_users(preset, monkeypatch):
    from ddp_plugins.config import group_options
    from ddp_plugins.train import compose_config

    assert sorted(group_options("network")) == sorted(DOCUMENTED)
    env = compose_config([f"network={preset}"]).network.env
    for key in _ALL_PRESET_KEYS:  # setenv first so that monkeypatch restores what the preset sets
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    before = dict(os.environ)
    assert apply_network_env(env) == DOCUMENTED[preset]
    changed = {k: v for k, v in os.environ.items() if before.get(k) != v}
    assert changed == DOCUMENTED[preset] and set(before) <= set(os.environ)

    user_key = sorted(DOCUMENTED[preset])[-1]
    monkeypatch.setenv(user_key, "user-value")
    for key in DOCUMENTED[preset]:
        if key != user_key:
            monkeypatch.delenv(key)
    assert apply_network_env(env)[user_key] == "user-value" and os.environ[user_key] == "user-value"


def test_rendezvous_store_listens_on_every_interface_as_documented():
    """The module docstring says torch's TCPStore binds the wildcard address whatever MASTER_ADDR is."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if Path(table).exists():
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and local.endswith(f":{port:04X}"):
                    listening.append(local.split(":")[0])
    del store
    assert listening and all(set(address) == {"0"} for address in listening), listening


# ---------------------------------------------------------------- no hangs when a rank fails

FAIL_TIMEOUT = 20  # the strategy's collective timeout in the failure runs, seconds


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
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        fail = ("loader", self.fail_rank) if self.mode == "loader" and self.global_rank == self.fail_rank else None
        return torch.utils.data.DataLoader(_FailingDataset(fail), batch_size=4, num_workers=1 if fail else 0)


def _fit_and_fail(out_dir, mode, rank):
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPPluginsStrategy(backend="gloo", timeout=FAIL_TIMEOUT),
        max_epochs=1, enable_progress_bar=False, logger=False, enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(_FailingModel(mode, rank))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "rank", "message"),
    [
        ("raise", 1, "RuntimeError: boom in training_step of rank 1"),
        ("raise", 0, "RuntimeError: boom in training_step of rank 0"),
        ("loader", 1, "ValueError: boom in a dataloader worker of rank 1"),
        ("sigkill", 1, "was killed by signal SIGKILL"),
        ("sigkill", 0, "[ddp_plugins] rank 1: a collective failed because another rank stopped"),
    ],
)
def test_a_failing_rank_ends_every_process_non_zero_within_the_timeout(mode, rank, message):
    with tempfile.TemporaryDirectory(prefix="ddp_plugins_fail_") as out_dir:
        (Path(out_dir) / "args.pkl").write_bytes(pickle.dumps((mode, rank)))
        cmd = [sys.executable, "-m", "tests.helpers.launch", f"{__name__}:_fit_and_fail", out_dir]
        start = time.monotonic()
        # every rank and dataloader worker holds the output pipes: run_command returns once all are gone
        result = run_command(cmd, FAIL_TIMEOUT + 30, env=loopback_env(MASTER_PORT=str(free_port())))
        elapsed = time.monotonic() - start
    assert result.returncode != 0, f"exit code 0 after {mode} on rank {rank}\n{result.stderr[-3000:]}"
    assert elapsed < FAIL_TIMEOUT + 30
    assert message in result.stderr, f"{message!r} not shown:\n{result.stderr[-4000:]}"
    if mode == "sigkill" and rank == 1:  # named by the rank watcher, or by rank 0 if its collective failed first
        assert re.search(r"\[ddp_plugins\] rank 1 \(PID \d+\) was killed by signal SIGKILL", result.stderr)
