"""ResumableTensorBoardLogger keeps every point logged before a ``kill -9``; a writer package that
does not import is refused by the app's pre-check in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ddp_plugins.lightning import tensorboard_logger
from tests.helpers import REPO_ROOT
from tests.helpers.tensorboard import event_files, read_event_file

# Logs `x` at every step; at the end of batch KILL_AT the callback saves a checkpoint and kills
# the process outright: the points of batches 0 to KILL_AT - 1 (steps 0 to KILL_AT - 1) were logged before
# the checkpoint (Lightning logs a batch's metrics after its on_train_batch_end)
KILL_AT = 6
_WRITER = textwrap.dedent(
    f"""
    import os, signal, sys
    import torch
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel
    from ddp_plugins.lightning import ResumableTensorBoardLogger

    class Logged(BoringModel):
        def training_step(self, batch, batch_idx):
            self.log("x", float(self.global_step), on_step=True, on_epoch=False)
            return super().training_step(batch, batch_idx)

    class CheckpointThenKill(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == {KILL_AT}:
                trainer.save_checkpoint(os.path.join(sys.argv[1], "step.ckpt"))
                os.kill(os.getpid(), signal.SIGKILL)

    logger = ResumableTensorBoardLogger(sys.argv[1], name="tensorboard", version="")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=20, limit_val_batches=0, log_every_n_steps=1,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      logger=logger, callbacks=[CheckpointThenKill()])
    trainer.fit(Logged())
    """
)


@pytest.mark.timeout(120)
def test_every_point_logged_before_a_checkpoint_survives_a_kill_9(tmp_path):
    killed = subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path)], capture_output=True, text=True,
                            cwd=REPO_ROOT, timeout=100)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "step.ckpt").is_file(), "the checkpoint was not saved before the kill"
    (events,) = event_files(tmp_path / "tensorboard")
    steps = [scalar.step for scalar in read_event_file(events).scalars if scalar.tag == "x"]
    assert steps == list(range(KILL_AT)), f"logged steps 0 to {KILL_AT - 1} before the checkpoint, the file has {steps}"


def test_a_writer_package_that_does_not_import_is_one_line_before_start_up(tmp_path):
    """What a tensorboardX built for another protobuf does at import: the pre-check imports it."""
    broken = tmp_path / "site" / "tensorboardX"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise TypeError("Descriptors cannot be created directly.")\n')
    env_path = f"{broken.parent}:{REPO_ROOT}"
    result = subprocess.run([sys.executable, "-m", "ddp_plugins.train", "logger=tensorboard", "hydra.run.dir=run"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=100,
                            env={**os.environ, "PYTHONPATH": env_path})  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (
        "error: logger got 'tensorboard', but tensorboardX is installed but does not import"
        " (TypeError: Descriptors cannot be created directly.), allowed: 'csv', or 'tensorboard' after"
        " `pip install 'ddp_plugins[tensorboard]'`"
    ), result.stderr[-3000:]
    assert not (tmp_path / "run").exists(), "a refused run writes no folder"


def test_a_writer_that_imports_passes_the_check():
    assert tensorboard_logger.writer_problem() is None, "the test environment's tensorboardX imports"
