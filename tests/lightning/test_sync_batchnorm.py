"""The Lightning adapters of SyncBatchNorm: the callback and the LayerSync plugin, on 2 CPU processes.

The synchronized math itself (core) is tested in tests/core/test_sync_batchnorm.py.
"""

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins import TorchSyncBatchNorm
from torch import nn

from ddp_plugins.lightning.layer_sync import SyncBatchNormPlugin
from ddp_plugins.lightning.sync_batchnorm import SyncBatchNormCallback
from ddp_plugins.testing import run_lightning
from tests.core.test_sync_batchnorm import TOL, BNAct, GainNorm


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"`group_size` should be an integer >= 1 or None, got 0\."):
        SyncBatchNormCallback(group_size=0)
    with pytest.raises(ValueError, match=r"`group_size` should be None when `process_group` is given, got 2\."):
        SyncBatchNormPlugin(process_group=object(), group_size=2)
    with pytest.raises(ValueError, match=r"`extra_classes` should be importable classes, got 'tests.nowhere.Norm', "):
        SyncBatchNormCallback(extra_classes=["tests.nowhere.Norm"])


class _BNModule(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4), BNAct(4))


@pytest.mark.parametrize(
    "already",
    [
        pytest.param(TorchSyncBatchNorm(), id="Trainer(sync_batchnorm=True)"),
        pytest.param(SyncBatchNormPlugin(), id="SyncBatchNormPlugin"),
    ],
)
def test_callback_refuses_a_model_already_synchronized_at_fit_start(already):
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    module = _BNModule()
    already.apply(module)  # what the strategy does with its LayerSync plugin before on_fit_start
    classes = [type(m) for m in module.modules()]
    callback = SyncBatchNormCallback()
    callback.setup(trainer, module, "fit")
    with pytest.raises(ValueError, match=r"`SyncBatchNormCallback` found layers already synchronized \(net.1, net.2\)"):
        callback.on_fit_start(trainer, module)
    callback.teardown(trainer, module, "fit")
    assert [type(m) for m in module.modules()] == classes, "the callback touched a model it refused"


def test_callback_converts_at_fit_start_and_reverts_at_teardown_and_on_exception():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    callback, module = SyncBatchNormCallback(), _BNModule()
    for end in ("teardown", "on_exception"):
        callback.setup(trainer, module, "fit")
        callback.on_fit_start(trainer, module)
        assert [type(m).__name__ for m in module.net] == ["Conv2d", "SyncBatchNorm2d", "SyncBNAct"]
        assert str(callback.report) == "SyncBatchNorm: converted 2 layer(s)"
        if end == "teardown":
            callback.teardown(trainer, module, "fit")
        else:
            callback.on_exception(trainer, module, RuntimeError("boom"))
        assert [type(m) for m in module.net] == [nn.Conv2d, nn.BatchNorm2d, BNAct], f"not reverted at {end}"


def test_group_size_that_does_not_divide_the_trainer_world_fails_at_setup():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    callback = SyncBatchNormCallback(group_size=3)
    with pytest.raises(ValueError, match=r"`group_size` should be a divisor of the world size 2, got 3\."):
        callback.setup(trainer, _BNModule(), "fit")
    SyncBatchNormCallback(group_size=2).check_trainer(trainer, _BNModule())  # divides: no error


def test_hydra_config_instantiates_the_callback():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from tests.helpers import REPO_ROOT

    config = OmegaConf.load(REPO_ROOT / "conf" / "callbacks" / "sync_batchnorm.yaml")
    callback = instantiate(config)
    assert isinstance(callback, SyncBatchNormCallback)
    assert callback.plugin.group_size is None and callback.plugin.skip_frozen is True
    declared = instantiate(config, extra_classes={"tests.core.test_sync_batchnorm.GainNorm": "normalize"})
    assert declared.plugin.extra_classes == {GainNorm: "normalize"}


# --- Lightning on 2 CPU processes ---


def _lightning_data():
    gen = torch.Generator().manual_seed(7)
    return torch.randn(16, 2, 4, 4, generator=gen), torch.randn(16, generator=gen)


def _lightning_net():
    torch.manual_seed(11)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), BNAct(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 1),
    )  # fmt: skip


def _fit_on_two_cpus(out_dir):
    import os

    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    class Regressor(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _lightning_net()
            self.classes_seen, self.indices = None, []

        def on_train_batch_start(self, batch, batch_idx):
            self.classes_seen = self.classes_seen or [type(m).__name__ for m in self.net]

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            self.indices.append(index)  # the sampler shuffles: the reference replays these batches
            return F.mse_loss(self.net(x).squeeze(1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = DataLoader(TensorDataset(*_lightning_data(), torch.arange(16)), batch_size=4)
    common = dict(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, enable_progress_bar=False,
                  logger=False, enable_model_summary=False)  # fmt: skip

    # 1. Lightning's own flag on CPU
    try:
        Trainer(sync_batchnorm=True, enable_checkpointing=False, **common).fit(Regressor(), loader)
        plain_error = None
    except Exception as err:  # noqa: BLE001 - the failure is what this run records
        plain_error = f"{type(err).__name__}: {err}"

    # 2. the callback, with a checkpoint written while the model is converted
    callback, model = SyncBatchNormCallback(), Regressor()
    checkpoint = ModelCheckpoint(dirpath=out_dir, filename="last")
    Trainer(callbacks=[callback, checkpoint], **common).fit(model, loader)
    restored = _lightning_net()
    state = torch.load(os.path.join(out_dir, "last.ckpt"), weights_only=True)["state_dict"]
    restored.load_state_dict({k.removeprefix("net."): v for k, v in state.items()}, strict=True)
    return {
        "plain_error": plain_error,
        "indices": model.indices,
        "classes_during_fit": model.classes_seen,
        "classes_after_fit": [type(m).__name__ for m in model.net],
        "report": str(callback.report),
        "state": {k: v.clone() for k, v in model.net.state_dict().items()},
        "checkpoint_state": restored.state_dict(),
    }


@pytest.mark.slow
def test_lightning_fit_on_cpu_with_the_callback_equals_one_process():
    results = run_lightning(_fit_on_two_cpus, world_size=2, timeout=240)
    # the single-process reference: the same 2 steps on global batches of 8 (both ranks' samples together)
    net = _lightning_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = _lightning_data()
    assert [len(r["indices"]) for r in results] == [2, 2]
    for step in range(2):
        rows = torch.cat([r["indices"][step] for r in results])
        assert sorted(rows.tolist()) == sorted(set(rows.tolist())), "ranks should see disjoint samples"
        optimizer.zero_grad()
        F.mse_loss(net(x[rows]).squeeze(1), y[rows]).backward()
        optimizer.step()
    for rank, result in enumerate(results):
        assert result["plain_error"] is not None, "Trainer(sync_batchnorm=True) was expected to fail on CPU"
        assert "GPU" in result["plain_error"], result["plain_error"]
        assert result["classes_during_fit"][1:4] == ["SyncBNAct", "Conv2d", "SyncBatchNorm2d"]
        assert result["classes_after_fit"][1:4] == ["BNAct", "Conv2d", "BatchNorm2d"], "not reverted after fit"
        assert result["report"] == "SyncBatchNorm: converted 2 layer(s)"
        for key, want in net.state_dict().items():
            torch.testing.assert_close(result["state"][key], want, **TOL, msg=f"{key} on rank {rank}")
            torch.testing.assert_close(result["checkpoint_state"][key], want, **TOL, msg=f"checkpoint {key}")
