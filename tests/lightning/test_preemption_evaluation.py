"""A checkpoint loaded to test, validate or predict after ``fit`` is no resume (issue 49).

``PreemptionCheckpoint`` cuts ``metrics.csv`` back to a checkpoint's rows when ``fit`` resumes from it
(the rows after it are logged again). lightning-hydra-template's ``train.py`` ends every run with
``trainer.test(ckpt_path="best")``: loading the best checkpoint there must leave every epoch's rows
of the plain Lightning ``CSVLogger`` in place, and only add the evaluation's own.
"""

from __future__ import annotations

import os

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from ddp_plugins.lightning import DDPPluginsStrategy, PreemptionCheckpoint
from ddp_plugins.testing import run_lightning
from tests.helpers.runs import metrics_rows


class _Scored(BoringModel):
    """Logs a train loss and a validation ``score`` that is highest in epoch 1 of 0, 1, 2: the best
    checkpoint is not the last one."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"], on_step=False, on_epoch=True, sync_dist=True)
        return out

    def validation_step(self, batch, batch_idx):
        self.log("score", float(self.current_epoch == 1), on_epoch=True, sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.step(batch), on_epoch=True, sync_dist=True)


def _fit_then_evaluate(folder, fn, ckpt, devices=1):
    """Fit 3 epochs, then ``trainer.<fn>(ckpt_path=...)``; metrics.csv's rows after each (on rank 0)."""
    best = ModelCheckpoint(
        dirpath=os.path.join(folder, "best"), filename="epoch{epoch}", monitor="score", mode="max", save_top_k=-1,
        save_last=True, auto_insert_metric_name=False,
    )  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=DDPPluginsStrategy(backend="gloo") if devices > 1 else "auto",
        max_epochs=3, default_root_dir=folder, logger=CSVLogger(folder, name="metrics", version=""),
        callbacks=[PreemptionCheckpoint(every_n_train_steps=1), best], limit_train_batches=2, limit_val_batches=2,
        limit_test_batches=2, limit_predict_batches=2, log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    model = _Scored()
    trainer.fit(model)
    fitted = metrics_rows(folder) if trainer.is_global_zero else None
    best_path = best.best_model_path  # loading another checkpoint restores the callback's state from it
    ckpt_path = os.path.join(folder, "best", "epoch0.ckpt") if ckpt == "epoch0" else ckpt
    getattr(trainer, fn)(model, ckpt_path=ckpt_path)
    return {
        "best": os.path.basename(best_path),
        "loaded": os.path.basename(str(trainer.ckpt_path)),
        "fitted": fitted,
        "after": metrics_rows(folder) if trainer.is_global_zero else None,
    }


def _two_ranks(out_dir, fn, ckpt):
    return _fit_then_evaluate(os.path.join(out_dir, "run"), fn, ckpt, devices=2)


def _assert_rows_kept(result, fn, ckpt, loaded):
    assert result["best"] == "epoch1.ckpt", f"the best checkpoint should be epoch 1's, not the last: {result['best']}"
    assert result["loaded"] == loaded, f"{fn} loaded {result['loaded']}, expected {loaded}"
    fitted, after = result["fitted"], result["after"]
    epochs = sorted({int(row["epoch"]) for row in fitted if "train_loss" in row})
    assert epochs == [0, 1, 2], f"fit should have logged a train row for each of 3 epochs, got {epochs}"
    assert after[: len(fitted)] == fitted, (
        f"{fn}(ckpt_path={ckpt!r}) should keep all {len(fitted)} rows fit logged; "
        f"{len(after)} rows after it, starting {after[: len(fitted)]}"
    )
    added = after[len(fitted) :]
    if fn == "predict":
        assert added == [], f"predict logs nothing, yet rows were added: {added}"
    else:
        key = "test_loss" if fn == "test" else "score"
        assert added and all(key in row for row in added), f"{fn} should append its {key} row(s), got {added}"


def test_one_process_test_of_the_best_checkpoint_keeps_every_logged_row(tmp_path):
    _assert_rows_kept(_fit_then_evaluate(str(tmp_path), "test", "best"), "test", "best", "epoch1.ckpt")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fn", "ckpt", "loaded"),
    [("test", "best", "epoch1.ckpt"), ("validate", "epoch0", "epoch0.ckpt"), ("predict", "best", "epoch1.ckpt")],
)
def test_two_ranks_loading_a_checkpoint_to_evaluate_keep_every_logged_row(fn, ckpt, loaded):
    result = run_lightning(_two_ranks, fn, ckpt, world_size=2, timeout=90)[0]
    _assert_rows_kept(result, fn, ckpt, loaded)
