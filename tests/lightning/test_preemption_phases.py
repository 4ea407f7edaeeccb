"""SIGTERM in every phase of a step and an epoch: one stop, one step checkpoint, a bit-identical resume (issue 50).

A preemption may land anywhere: in the backward, before the optimizer step, in a validation step run
in the middle of an epoch, in a callback's epoch end (listed before ``PreemptionCheckpoint``), at the
validation epoch's end, while a checkpoint is written. Each cell sends SIGTERM to one rank of 2 there
(the other rank gets nothing), and needs: every rank stops at the same step with ``Preempted`` (exit
143) and the step's checkpoint, and the run resumed from it ends with the uninterrupted run's
parameters and optimizer state, bit for bit (``RankAwareSeed`` resumes dropout's streams). The epoch's last step is
``tests/lightning/test_preemption_epoch_end.py``'s; the app's own cells are in ``tests/app/test_preemption.py``.
"""

from __future__ import annotations

import os
import re
import signal

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from ddp_plugins.core import Preempted
from ddp_plugins.lightning import DDPPluginsStrategy, PreemptionCheckpoint, RankAwareSeed
from ddp_plugins.testing import run_lightning
from tests.helpers.interrupt import SignalAt
from tests.helpers.models import three_classes

pytestmark = pytest.mark.usefixtures("clean_process_state")


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 3))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train/loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.cross_entropy(self.net(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(three_classes(48, 1), batch_size=4, shuffle=True)  # 6 steps an epoch on 2 ranks

    def val_dataloader(self):
        return DataLoader(three_classes(16, 2), batch_size=4)


def _fit(folder, signal_at=None, ckpt_path=None):
    os.makedirs(folder, exist_ok=True)  # SignalAt's marker file is written there
    preemption = PreemptionCheckpoint(every_n_train_steps=4, check_every_n_steps=1)
    callbacks = [*([signal_at] if signal_at else []), RankAwareSeed(seed=3), preemption]  # dropout's streams resume
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPPluginsStrategy(backend="gloo", timeout=30), max_epochs=2,
        default_root_dir=folder, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, val_check_interval=3, num_sanity_val_steps=0,
    )  # fmt: skip
    model = _Net()
    trainer.fit(model, ckpt_path=ckpt_path)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    momentum = [s["momentum_buffer"].clone() for s in trainer.optimizers[0].state.values()]
    return {"state": state, "momentum": momentum}


def _cell(out_dir, hook, step, rank):
    reference = _fit(os.path.join(out_dir, "reference"))
    folder = os.path.join(out_dir, "run")
    try:
        _fit(folder, SignalAt(hook, step=step, rank=rank))
        return {"stopped": None}
    except Preempted as stop:
        code, checkpoint = stop.code, stop.checkpoint
    resumed = _fit(os.path.join(out_dir, "resumed"), ckpt_path=checkpoint)
    return {"stopped": (code, os.path.basename(checkpoint)), "reference": reference, "resumed": resumed}


PHASES = {  # hook, the first global step it fires at, the rank that gets the signal
    "the backward": ("after_backward", 2, 1),
    "before the optimizer step": ("before_optimizer_step", 3, 0),
    "a validation step mid-epoch": ("validation_batch_start", 0, 1),
    "a callback's epoch end": ("train_epoch_end", 0, 1),
    "the validation epoch's end": ("validation_epoch_end", 4, 0),
    "a checkpoint save": ("save_checkpoint", 0, 1),
}

IN_MAKE_TEST = ("the backward", "a checkpoint save")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "phase", [p if p in IN_MAKE_TEST else pytest.param(p, marks=pytest.mark.e2e) for p in PHASES]
)  # two cells in make test, the others in make test-e2e (each about 15 s of 2 ranks)
def test_a_sigterm_in_any_phase_stops_every_rank_at_one_step_and_resumes_bit_identically(phase):
    hook, step, rank = PHASES[phase]
    results = run_lightning(_cell, hook, step, rank, timeout=200)
    stops = [result["stopped"] for result in results]
    assert stops[0] is not None and stops == [stops[0]] * len(stops), f"the ranks stopped at {stops}"
    code, name = stops[0]
    assert code == 128 + signal.SIGTERM and re.fullmatch(r"step-\d+-preempted\.ckpt", name), stops[0]
    for result in results:
        reference, resumed = result["reference"], result["resumed"]
        for key, value in reference["state"].items():
            assert torch.equal(resumed["state"][key], value), f"{phase}: {key} differs after the resume ({name})"
        for got, want in zip(resumed["momentum"], reference["momentum"], strict=True):
            assert torch.equal(got, want), f"{phase}: the momentum differs after the resume ({name})"
