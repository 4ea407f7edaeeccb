"""Checkpoint folders that Lightning's own file-name scans read as they read its own: HPC resume,
ModelCheckpoint's version numbers and ``last`` links; and digests of an earlier version still verify."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ddp_plugins.core.checkpoints import (
    digest_path,
    newest_valid_checkpoint,
    remove_checkpoint_file,
    save_checkpoint_file,
    verify_checkpoint,
    write_number,
)
from ddp_plugins.lightning import AtomicCheckpointIO, DDPPluginsStrategy

pytestmark = pytest.mark.usefixtures("clean_process_state")  # Trainers of the pack's strategy run here


def _trainer(root: Path, max_steps: int, **kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=1, strategy=DDPPluginsStrategy(), max_steps=max_steps, limit_val_batches=0,
        enable_progress_bar=False, enable_model_summary=False, logger=False, default_root_dir=root, **kwargs,
    )  # fmt: skip


def _visible(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if not name.startswith("."))


def test_lightning_s_own_hpc_resume_finds_the_checkpoint_our_io_wrote(tmp_path):
    first = _trainer(tmp_path, 3, enable_checkpointing=False)
    assert isinstance(first.strategy.checkpoint_io, AtomicCheckpointIO), "the strategy's default writes the file"
    first.fit(BoringModel())
    first.save_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")  # what Lightning's SLURM requeue handler writes
    assert verify_checkpoint(tmp_path / "hpc_ckpt_1.ckpt") is None

    resumed = _trainer(tmp_path, 5, enable_checkpointing=False)
    # Lightning's own lookup, the largest N of every name holding hpc_ckpt_<N>: a digest beside the file,
    # hpc_ckpt_1.ckpt.sha256, read as version 1256 (FileNotFoundError: ...hpc_ckpt_1256.ckpt)
    resumed.fit(BoringModel(), ckpt_path="hpc")
    assert Path(resumed.ckpt_path) == tmp_path / "hpc_ckpt_1.ckpt"
    assert resumed.global_step == 5, "it went on from step 3"
    assert _visible(tmp_path) == ["hpc_ckpt_1.ckpt"], "only Lightning's own names in the folder"


@pytest.mark.parametrize("save_last", [True, "link"])
def test_model_checkpoint_names_and_last_links_are_those_without_our_io(tmp_path, save_last):
    def run(root: Path, io) -> list[str]:
        kwargs = {} if io is None else {"plugins": [io]}
        for _ in range(2):  # a second run in the same folder: every name exists, so `-v1` versions
            callback = ModelCheckpoint(dirpath=root, filename="same", every_n_train_steps=2, save_top_k=-1,
                                       save_last=save_last, enable_version_counter=True)  # fmt: skip
            _trainer(root, 4, callbacks=[callback], **kwargs).fit(BoringModel())
        return _visible(root)

    ours = run(tmp_path / "ours", None)
    lightning_s = run(tmp_path / "lightning", TorchCheckpointIO())
    assert ours == lightning_s and any("-v1" in name for name in ours), (ours, lightning_s)
    for name in ours:
        assert verify_checkpoint(tmp_path / "ours" / name) is None, f"{name} does not verify"
    if save_last == "link":  # a link is vouched for by its target's digest
        assert (tmp_path / "ours" / "last.ckpt").is_symlink()


def _old_style_sidecar(checkpoint: Path, number: int) -> Path:
    """What ddp_plugins 0.3.1 before the hidden folder wrote: ``<name>.sha256`` beside the file."""
    sidecar = checkpoint.with_name(checkpoint.name + ".sha256")
    digest = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    sidecar.write_text(f"{digest}  {checkpoint.name}\n# write {number}\n")
    return sidecar


def test_an_old_style_sidecar_beside_the_checkpoint_still_verifies_and_orders(tmp_path):
    old = tmp_path / "step-2.ckpt"
    save_checkpoint_file({"step": 2}, old)
    remove_checkpoint_file(tmp_path / "unrelated.ckpt")  # nothing there: no error
    digest_path(old).unlink()
    sidecar = _old_style_sidecar(old, 7)
    assert digest_path(old) == sidecar and verify_checkpoint(old) is None and write_number(old) == 7
    with open(old, "r+b") as file:  # the old sidecar is still checked, not just present
        file.seek(64)
        file.write(b"garbage")
    assert verify_checkpoint(old) == "damaged: its SHA-256 does not match step-2.ckpt.sha256"
    save_checkpoint_file({"step": 2}, old)  # rewritten: its stale old-style sidecar goes
    assert not sidecar.exists() and digest_path(old).parent.name == ".sha256" and verify_checkpoint(old) is None
    assert write_number(old) == 8, "numbered after every sidecar of the folder, old-style ones included"

    legacy = tmp_path / "step-4.ckpt"
    save_checkpoint_file({"step": 4}, legacy)
    digest_path(legacy).unlink()
    _old_style_sidecar(legacy, 9)
    assert newest_valid_checkpoint(tmp_path) == (legacy, [])
    remove_checkpoint_file(legacy)
    assert _visible(tmp_path) == ["step-2.ckpt"], "a removed checkpoint takes its old-style sidecar with it"
