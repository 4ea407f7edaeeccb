"""The liveness room's rescue checkpoint resumes bit-identically (issue 50).

Rank 1 freezes (SIGSTOP) in the middle of the first epoch. Rank 0's room names it, ends the job at the
end limit and writes the last completed step's checkpoint while its training thread waits. The same fit
resumed from that checkpoint on 2 ranks must end with the uninterrupted run's parameters, BatchNorm
buffers (``num_batches_tracked`` included: the finding was one step too many) and momentum, bit for bit.
The model draws no random numbers: a stalled rank's random streams cannot be gathered into the rescue.
Limits of 2 s and 5 s stand for the defaults' 30 s and 300 s.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from ddp_plugins.core import liveness
from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from ddp_plugins.testing import _RankServer, free_port, run_lightning
from tests.helpers.models import three_classes

pytestmark = pytest.mark.slow
FREEZE_AT = 6


def _published_once() -> None:
    """Wait until this rank's room published its first record. A rank stopped before that is never named: rank 0
    judges only once every rank published (a known gap, seen once in CI under load; not what this test proves)."""
    deadline = time.monotonic() + 30
    while (room := liveness._room) is None or room._seq == 0:
        assert time.monotonic() < deadline, "the room published nothing within 30 s"
        time.sleep(0.05)


class _Net(pl.LightningModule):
    def __init__(self, freeze: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.freeze = freeze
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        if self.freeze and self.global_step == FREEZE_AT and self.global_rank == 1:
            _published_once()
            os.kill(os.getpid(), signal.SIGSTOP)
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(three_classes(96, 1, features=8), batch_size=4)


def _fit(out_dir: str, folder: str, freeze: bool = False, ckpt_path: str | None = None) -> dict:
    pl.seed_everything(3)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=2, default_root_dir=folder, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, sync_batchnorm=True,
        strategy=DDPPluginsStrategy(backend="gloo", stall_name_after=2, stall_end_after=5),
    )  # fmt: skip
    model = _Net(freeze)
    trainer.fit(model, ckpt_path=ckpt_path)
    momentum = [trainer.optimizers[0].state[p]["momentum_buffer"].clone() for p in model.parameters()]
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "momentum": momentum}


def _stalled(folder: Path) -> dict[int, int]:
    """The frozen run, through the rank server (its ranks exit non-zero: 1, and -9 for the frozen one)."""
    (folder / "args.pkl").write_bytes(pickle.dumps((str(folder), True)))
    request = {
        "target": f"{__name__}:_fit", "out_dir": str(folder), "world_size": 2,
        "env": {"MASTER_PORT": str(free_port()), "WORLD_SIZE_HINT": "2"}, "cwd": os.getcwd(), "path": sys.path,
        "timeout": 90,
    }  # fmt: skip
    return _RankServer.get().run(request, 90)


def test_the_rescue_checkpoint_of_a_frozen_rank_resumes_bit_identically(tmp_path):
    reference = run_lightning(_fit, str(tmp_path / "reference"), timeout=120)[0]
    folder = tmp_path / "stalled"
    folder.mkdir()
    codes = _stalled(folder)
    assert codes[0] == 1 and codes[1] in (1, -9), codes
    logs = "".join((folder / f"rank{r}.log").read_text(errors="replace") for r in (0, 1))
    (rescue,) = folder.rglob("step-*-stalled.ckpt")
    assert f"checkpoint of the last completed step: {rescue}" in logs, logs[-3000:]
    resumed = run_lightning(_fit, str(tmp_path / "resumed"), False, str(rescue), timeout=120)[0]
    for key, value in reference["state"].items():
        assert torch.equal(resumed["state"][key], value), f"{key} differs after resuming from {rescue.name}"
    for got, want in zip(resumed["momentum"], reference["momentum"], strict=True):
        assert torch.equal(got, want), f"the momentum differs after resuming from {rescue.name}"
