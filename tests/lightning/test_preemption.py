"""PreemptionCheckpoint in one process, and the rule that no state_dict of ours communicates."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from ddp_plugins.core import Preempted
from ddp_plugins.lightning import PreemptionCheckpoint, RankAwareSeed, ResumableCSVLogger


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="`every_n_train_steps` should be"):
        PreemptionCheckpoint(every_n_train_steps=-1)
    with pytest.raises(ValueError, match="`keep` should be"):
        PreemptionCheckpoint(keep=0)
    with pytest.raises(ValueError, match="`requeue` should be one of 'auto', 'always', 'never'"):
        PreemptionCheckpoint(requeue="sometimes")
    with pytest.raises(ValueError, match="`signals` should be signal names that can be caught"):
        PreemptionCheckpoint(signals=["SIGKILL"])
    with pytest.raises(ValueError, match="`check_every_n_steps` should be"):
        PreemptionCheckpoint(check_every_n_steps=0)


class _SigtermAt(Callback):
    def __init__(self, step: int, sig: int = signal.SIGTERM) -> None:
        self.step, self.sig = step, sig

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.sig)


def _trainer(tmp_path, *callbacks, **kwargs):
    return Trainer(
        accelerator="cpu", devices=1, max_steps=8, limit_val_batches=0, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=list(callbacks),
        logger=ResumableCSVLogger(tmp_path, name="metrics", version=""), log_every_n_steps=1, **kwargs,
    )  # fmt: skip


def test_sigterm_stops_after_the_step_with_one_checkpoint_and_exit_code_143(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    callback = PreemptionCheckpoint(every_n_train_steps=2, keep=2)
    trainer = _trainer(tmp_path, _SigtermAt(3), callback)
    with pytest.raises(Preempted) as stop:
        trainer.fit(BoringModel())
    assert stop.value.code == 128 + signal.SIGTERM
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert names == ["step-2.ckpt", "step-3-preempted.ckpt"], names
    assert torch.load(stop.value.checkpoint, weights_only=True)["global_step"] == 3
    assert trainer.global_step == 3, "no step ran after the agreed one"
    assert signal.getsignal(signal.SIGTERM) == before, "the handlers of the process are given back"


def test_in_a_submitit_job_usr2_stops_at_the_step_and_requeues(tmp_path, monkeypatch):
    """submitit asks Slurm for USR2 before the time limit and would requeue from inside its
    handler on rank 0; the callback takes USR2 at the step boundary and requeues from there."""
    requeued = []
    monkeypatch.setattr("ddp_plugins.lightning.preemption.slurm_requeue", lambda: requeued.append(True))
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "41")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    submitits_handler = lambda signum, frame: pytest.fail("submitit's handler ran during training")  # noqa: E731
    previous = signal.signal(signal.SIGUSR2, submitits_handler)
    try:
        callback = PreemptionCheckpoint()
        trainer = _trainer(tmp_path, _SigtermAt(3, signal.SIGUSR2), callback)
        # Slurm signals every task for the requeue while it tears down: until Lightning puts back the
        # handlers it found, SIGTERM must be ours, not Lightning's (which broadcasts in the handler)
        during_teardown = []
        connector = trainer._signal_connector
        original_teardown = connector.teardown
        monkeypatch.setattr(connector, "teardown", lambda: (during_teardown.append(signal.getsignal(signal.SIGTERM)),
                                                            original_teardown()))  # fmt: skip
        with pytest.raises(Preempted) as stop:
            trainer.fit(BoringModel())
        assert stop.value.code == 128 + signal.SIGUSR2 and trainer.global_step == 3
        assert requeued == [True], "the job requeues itself once, from rank 0"
        assert during_teardown == [callback._flag._handle], f"SIGTERM went to {during_teardown} during teardown"
        assert signal.getsignal(signal.SIGUSR2) is submitits_handler, "submitit's handler is given back"
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_slurm_signal_at_the_last_step_finishes_the_job_without_a_requeue(tmp_path, monkeypatch):
    """Issue 45: Slurm's USR1 agreed at the last step has nothing left to stop. The run ends as a
    finished one and the job is not requeued (a requeued job would only say it had finished)."""
    requeued = []
    monkeypatch.setattr("ddp_plugins.lightning.preemption.slurm_requeue", lambda: requeued.append(True))
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    callback = PreemptionCheckpoint(check_every_n_steps=1)
    trainer = _trainer(tmp_path, _SigtermAt(8, signal.SIGUSR1), callback)
    trainer.fit(BoringModel())  # no Preempted: training and its end ran
    assert callback.signal_received == signal.SIGUSR1, "the signal was not received"
    assert trainer.global_step == 8 and requeued == [], "a finished job was requeued"
    assert (tmp_path / "checkpoints" / "step-8-preempted.ckpt").exists()


def test_a_slurm_signal_before_the_last_step_requeues_once(tmp_path, monkeypatch):
    requeued = []
    monkeypatch.setattr("ddp_plugins.lightning.preemption.slurm_requeue", lambda: requeued.append(True))
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    trainer = _trainer(tmp_path, _SigtermAt(5, signal.SIGUSR1), PreemptionCheckpoint(check_every_n_steps=1))
    with pytest.raises(Preempted) as stop:
        trainer.fit(BoringModel())
    assert stop.value.signum == signal.SIGUSR1 and trainer.global_step == 5 and requeued == [True]


def test_step_checkpoints_keep_the_newest_and_finish_normally(tmp_path):
    trainer = _trainer(tmp_path, PreemptionCheckpoint(every_n_train_steps=2, keep=2))
    trainer.fit(BoringModel())
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt")) == ["step-6.ckpt", "step-8.ckpt"]
    ledger = (tmp_path / "checkpoints" / "metrics_rows.json").read_text()
    assert '"step-8.ckpt"' in ledger and '"step-2.ckpt"' not in ledger, "the ledger forgets pruned files"


def test_accumulation_windows_are_never_cut(tmp_path):
    """With 3 batches per step, the signal mid-window stops only after the window's optimizer step."""

    class SigtermAtBatch(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 4:  # the 2nd batch of the 2nd window
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = _trainer(tmp_path, SigtermAtBatch(), PreemptionCheckpoint(), accumulate_grad_batches=3)
    with pytest.raises(Preempted):
        trainer.fit(BoringModel())
    assert trainer.global_step == 2 and trainer.fit_loop.epoch_loop.batch_progress.current.processed == 6


def _no_collectives(rank, world_size):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("a collective was issued")

    names = ("all_gather_object", "all_gather", "all_reduce", "broadcast", "broadcast_object_list", "barrier")
    saved = {name: getattr(dist, name) for name in names}
    try:
        for name in names:
            setattr(dist, name, refuse)
        state = RankAwareSeed(seed=3).state_dict()
    finally:  # the pool's ranks serve the other tests
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return state["world_size"], sorted(state["per_rank"])


def test_rank_aware_seed_state_dict_issues_no_collective(dist_pool):
    for world_size, keys in dist_pool.run(_no_collectives):
        assert world_size == 2 and keys == ["numpy", "python", "torch", "torch.cuda"]


def test_rescue_checkpoints_of_the_liveness_room_are_pruned_with_the_step_checkpoints(tmp_path):
    """A stalled run left ``step-N-stalled.ckpt`` files: the next run's step checkpoints count them
    (the newest ``keep`` of both are kept), as preemption checkpoints are counted."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in ("step-1-stalled.ckpt", "step-3-stalled.ckpt"):
        (folder / name).write_bytes(b"an older run's rescue")
        time.sleep(0.01)  # write order: by modification time where the checkpoint IO recorded none
    trainer = _trainer(tmp_path, PreemptionCheckpoint(every_n_train_steps=2, keep=2))
    trainer.fit(BoringModel())
    names = sorted(p.name for p in folder.glob("*.ckpt"))
    assert names == ["step-6.ckpt", "step-8.ckpt"], names
