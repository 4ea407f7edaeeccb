"""Weights-only loads of what a Lightning + Hydra project saves (issue 53): lightning-hydra-template's
layout loads with no change, anything else is refused in one line that names the way through.

One CPU process with the pack's strategy (its checkpoint IO is ``AtomicCheckpointIO``): the loads are
the same on every rank, so one rank shows them.
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.parsing import AttributeDict
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from ddp_plugins.lightning import AtomicCheckpointIO, DDPPluginsStrategy

pytestmark = pytest.mark.usefixtures("clean_process_state")  # Trainers of the pack's strategy run here

# lightning-hydra-template's configs/data/mnist.yaml and configs/model/mnist.yaml, shrunk: a list
# for the split, a partial optimizer and an nn.Module built by Hydra
DATA_YAML = f"""\
_target_: {__name__}.TemplateDataModule
data_dir: ${{paths.data_dir}}
batch_size: 8
train_val_test_split: [48, 8, 8]
num_workers: 0
pin_memory: False
"""
MODEL_YAML = f"""\
_target_: {__name__}.TemplateLitModule
optimizer:
  _target_: torch.optim.Adam
  _partial_: true
  lr: 0.01
net:
  _target_: torch.nn.Linear
  in_features: 4
  out_features: 2
head:
  widths: [4, 2]
  dropout: 0.0
"""
TRAIN_YAML = """\
defaults:
  - _self_
  - data: mnist
  - model: mnist
paths:
  data_dir: data/
"""


class TemplateDataModule(LightningDataModule):
    """The template's ``MNISTDataModule``: its ``__init__`` arguments saved as they come from Hydra."""

    def __init__(
        self, data_dir: str = "data/", train_val_test_split: Any = (48, 8, 8), batch_size: int = 8,
        num_workers: int = 0, pin_memory: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters(logger=False)

    def setup(self, stage: str) -> None:
        rows = sum(self.hparams.train_val_test_split)
        data = TensorDataset(torch.randn(rows, 4, generator=torch.Generator().manual_seed(0)), torch.arange(rows) % 2)
        self.train, self.val, self.test = random_split(data, list(self.hparams.train_val_test_split))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.hparams.batch_size)


class TemplateLitModule(LightningModule):
    """The template's ``MNISTLitModule``; ``ignore`` as the class attribute says (the template ignores nothing)."""

    ignore: tuple[str, ...] = ()

    def __init__(self, net: nn.Module, optimizer: Any, head: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=list(self.ignore))
        self.net, self.make_optimizer = net, optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", nn.functional.cross_entropy(self.net(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test/loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return self.make_optimizer(params=self.parameters())


class PlainHyperparameters(TemplateLitModule):
    """The port docs/compatibility.md describes: the module and the partial kept out of the hyperparameters."""

    ignore = ("net", "optimizer")


def _compose(tmp_path: Path, overrides: list[str]) -> DictConfig:
    """The config as the template's ``@hydra.main`` composes it (configs/data, configs/model)."""
    configs = tmp_path / "configs"
    for name, text in (("train", TRAIN_YAML), ("data/mnist", DATA_YAML), ("model/mnist", MODEL_YAML)):
        (configs / f"{name}.yaml").parent.mkdir(parents=True, exist_ok=True)
        (configs / f"{name}.yaml").write_text(text)
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        return compose("train", overrides=overrides)


def _trainer(root: Path, **kwargs: Any) -> Trainer:
    best = ModelCheckpoint(dirpath=root / "checkpoints", monitor="val/loss", mode="min")
    return Trainer(
        accelerator="cpu", devices=1, strategy=DDPPluginsStrategy(), max_epochs=2, callbacks=[best],
        enable_progress_bar=False, enable_model_summary=False, logger=False, default_root_dir=root, **kwargs,
    )  # fmt: skip


def _fit(
    tmp_path: Path, model_class: type[TemplateLitModule], overrides: list[str]
) -> tuple[Trainer, LightningModule, Any]:
    cfg = _compose(tmp_path, overrides)
    datamodule = instantiate(cfg.data)  # what the template's train.py does
    model = instantiate(cfg.model, _target_=f"{__name__}.{model_class.__name__}")
    assert isinstance(datamodule.hparams.train_val_test_split, ListConfig), "Hydra passes the list as a ListConfig"
    trainer = _trainer(tmp_path)
    trainer.fit(model, datamodule=datamodule)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    return trainer, model, datamodule


@pytest.mark.parametrize("head", [False, True], ids=["template", "and_a_dictconfig"])
def test_the_template_s_hydra_configs_fit_then_test_best_with_no_change(tmp_path, head):
    trainer, model, datamodule = _fit(tmp_path, PlainHyperparameters, [] if head else ["~model.head"])
    assert isinstance(model.hparams.get("head"), DictConfig) == head, "Hydra passes a mapping as a DictConfig"
    before = torch.serialization.get_safe_globals()

    trainer.test(model, datamodule=datamodule, ckpt_path="best")  # the template's train.py ends with it

    assert Path(trainer.ckpt_path).name.startswith("epoch=") and "test/loss" in trainer.callback_metrics
    assert set(torch.serialization.get_safe_globals()) == set(before), "torch's allowlist is left as it was"
    loaded = AtomicCheckpointIO().load_checkpoint(trainer.ckpt_path)
    assert loaded["datamodule_hyper_parameters"]["train_val_test_split"] == [48, 8, 8]
    assert loaded["hyper_parameters"].get("head") == ({"widths": [4, 2], "dropout": 0.0} if head else None)
    with pytest.raises(pickle.UnpicklingError):  # torch alone still refuses them: the allowlist is ours, per load
        torch.load(trainer.ckpt_path, weights_only=True)


def test_a_module_and_a_partial_in_the_hyperparameters_are_refused_in_one_line_then_load_when_trusted(tmp_path):
    trainer, model, datamodule = _fit(tmp_path, TemplateLitModule, [])  # the template's model: nothing ignored
    best = trainer.checkpoint_callback.best_model_path
    partial = type(model.hparams.optimizer)  # functools.partial, or hydra-core 1.3.8's subclass of it

    with pytest.raises(pickle.UnpicklingError) as refused:
        trainer.test(model, datamodule=datamodule, ckpt_path="best")
    message = str(refused.value)
    assert "\n" not in message, f"not one line: {message}"
    assert isinstance(refused.value, ValueError), "a ValueError, as the pack's other refusals"
    for part in (best, f"{partial.__module__}.{partial.__qualname__}", "torch.nn.modules.linear.Linear", "Adam"):
        assert part in message, f"{part!r} not named in: {message}"
    assert "weights_only=False" in message and "save_hyperparameters(" in message, message

    trainer.test(model, datamodule=datamodule, ckpt_path="best", weights_only=False)  # the user trusts the file
    assert "test/loss" in trainer.callback_metrics


def test_lightning_s_plain_types_load_and_the_allowlist_leaves_what_the_user_allowed(tmp_path):
    path = tmp_path / "a.ckpt"
    plain = {"args": argparse.Namespace(lr=0.1), "data_dir": Path("data")}
    AtomicCheckpointIO().save_checkpoint({"hyper_parameters": {"split": OmegaConf.create([1, 2]), **plain}}, path)
    torch.serialization.add_safe_globals([ListConfig, functools.partial])  # the user's own, process-wide
    try:
        assert AtomicCheckpointIO().load_checkpoint(path)["hyper_parameters"] == {"split": [1, 2], **plain}
        assert {ListConfig, functools.partial} <= set(torch.serialization.get_safe_globals()), "still allowed"
    finally:
        torch.serialization.clear_safe_globals()
    # Lightning writes its AttributeDict as a dict; one nested in the hyperparameters is named (torch fills
    # no dict subclass)
    AtomicCheckpointIO().save_checkpoint({"hyper_parameters": {"other": AttributeDict(a=1)}}, path)
    with pytest.raises(pickle.UnpicklingError, match="it holds lightning.pytorch.utilities.parsing.AttributeDict"):
        AtomicCheckpointIO().load_checkpoint(path)


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.makedirs, (self.marker,))


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_a_pickle_that_runs_code_is_refused_in_one_line_and_runs_nothing(tmp_path, protocol):
    path, marker = tmp_path / "crafted.ckpt", tmp_path / "code-ran"
    path.write_bytes(pickle.dumps({"state_dict": _RunsCode(marker)}, protocol=protocol))
    with pytest.raises(pickle.UnpicklingError) as refused:
        AtomicCheckpointIO().load_checkpoint(path)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path} does not load with weights_only=True: "), message
    # torch names the global of a protocol-2 pickle; a later protocol's first frame is refused before it
    assert ("os.makedirs" if protocol == 2 else "Unsupported operand") in message, message
    assert not marker.exists(), "the crafted checkpoint's code ran"
