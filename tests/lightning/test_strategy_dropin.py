"""DDPPluginsStrategy takes what Lightning's DDPStrategy takes, with the same meaning."""

from datetime import timedelta

import pytest
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

from ddp_plugins.lightning import DDPPluginsStrategy
from ddp_plugins.lightning.layer_sync import SyncBatchNormPlugin


def test_process_group_backend_is_a_synonym_of_backend():
    assert DDPPluginsStrategy(process_group_backend="gloo").process_group_backend == "gloo"
    assert DDPPluginsStrategy(backend="gloo", process_group_backend="gloo").process_group_backend == "gloo"
    with pytest.raises(ValueError, match=r"`process_group_backend` should be the same as `backend` \('gloo'\)"):
        DDPPluginsStrategy(backend="gloo", process_group_backend="nccl")
    # backends torch knows besides ours pass through `process_group_backend=`; `backend=` names ours
    assert DDPPluginsStrategy(process_group_backend="ucc").process_group_backend == "ucc"
    with pytest.raises(ValueError, match=r"`backend` should be one of 'auto', 'gloo', 'nccl', 'mpi', got 'ucc'"):
        DDPPluginsStrategy(backend="ucc")


def test_timeout_in_seconds_or_as_a_timedelta():
    assert DDPPluginsStrategy(timeout=timedelta(minutes=2))._timeout == timedelta(seconds=120)
    assert DDPPluginsStrategy(timeout=90)._timeout == timedelta(seconds=90)
    with pytest.raises(ValueError, match="`timeout` should be a positive finite number of seconds"):
        DDPPluginsStrategy(timeout=timedelta(seconds=-1))
    with pytest.raises(TypeError, match="`timeout` should be"):
        DDPPluginsStrategy(timeout="soon")


@pytest.mark.parametrize("backend", ["gloo", "auto"])  # auto: the device decides, read at its local rank
@pytest.mark.parametrize("local_rank", ["0", "3"])  # 3: past `devices`, where a bare IndexError came first
def test_more_ranks_than_devices_under_torchrun_is_a_clear_error(monkeypatch, local_rank, backend):
    from lightning.pytorch import Trainer

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")
    env = {"WORLD_SIZE": "4", "RANK": local_rank, "LOCAL_RANK": local_rank, "GROUP_RANK": "0"}
    env.update(LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(
        ValueError, match=r"`devices` should be devices x num_nodes = the world size the launcher started \(4\)"
    ):
        Trainer(accelerator="cpu", devices=2, strategy=DDPPluginsStrategy(backend=backend), logger=False)


class _UserSyncBatchNorm(TorchSyncBatchNorm):
    pass


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"sync_batchnorm": True}, SyncBatchNormPlugin),  # the documented swap
        ({"plugins": [TorchSyncBatchNorm()]}, SyncBatchNormPlugin),  # torch's exact class: the drop-in too
        ({"plugins": TorchSyncBatchNorm()}, SyncBatchNormPlugin),
        ({"plugins": [_UserSyncBatchNorm()]}, _UserSyncBatchNorm),  # a subclass is the user's own: kept
        ({"plugins": [_UserSyncBatchNorm()], "sync_batchnorm": True}, _UserSyncBatchNorm),
        ({"plugins": [TorchSyncBatchNorm()], "sync_batchnorm": True}, SyncBatchNormPlugin),
        ({}, type(None)),
    ],
)
def test_torch_s_sync_batchnorm_plugin_becomes_the_drop_in_and_a_subclass_is_kept(kwargs, expected):
    """No stack frame is read to tell `sync_batchnorm=True` from `plugins=[TorchSyncBatchNorm()]`: torch's exact
    class is swapped for the device-agnostic drop-in either way (docs/plugins.md, SyncBN)."""
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPPluginsStrategy(backend="gloo"), logger=False, **kwargs)
    layer_sync = trainer.strategy._layer_sync
    assert type(layer_sync) is expected
    explicit = kwargs.get("plugins")
    if expected is _UserSyncBatchNorm:
        assert layer_sync is explicit[0], "the user's own object"
