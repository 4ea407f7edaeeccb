"""Preemption-safe training, end to end: interrupted runs resume and end bit-identical.

One reference run, then the same config interrupted by real signals at exact points (sent from
inside the run by :class:`tests.helpers.interrupt.SignalAt`) and resumed by the same command. Each
must end with parameters, BatchNorm buffers and optimizer state ``torch.equal`` to the reference's,
the same epoch and global step, and the same metrics CSV rows. The config has dropout, DataLoader
workers, step checkpoints and every plugin on.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddp_plugins.testing import check_ok, free_port, loopback_env, run_command
from tests.app.test_safety import _one_line_failure
from tests.helpers import REPO_ROOT
from tests.helpers.ledger import batches_of, rows_per_epoch
from tests.helpers.runs import assert_equal_states, final_state, metrics_rows
from tests.helpers.shared import made_once
from tests.helpers.slurm import job_fields, release_when_requeued, submit_requeue_job
from tests.helpers.tensorboard import event_files, read_event_file, scalar_series
from tests.helpers.warm import APP, run_warm

SMALL = [
    "data=synthetic", "data.num_samples=640", "model.channels=8", "model.dropout=0.2", "data.num_workers=2",
    "trainer.max_epochs=2", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1",
    "checkpoint.every_n_train_steps=2", "checkpoint.keep=2",
]  # fmt: skip  # 512 training samples: 8 steps per epoch on 2 ranks
RESUMING = re.compile(r"resuming from (\S+) \(epoch (\d+), step (\d+)\)")
LEDGER = "+callbacks.ledger._target_=tests.helpers.ledger.RowLedger"  # rows-rank<R>.jsonl: the rows each epoch trained


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    # A double quote and a space in the run folder (Hydra-quoted): the child rank's command line
    # must carry it intact, or rank 1 would write elsewhere and the reference would be incomplete.
    # resume=never in a new folder: the run starts from scratch (what every resumed run is compared to).
    def make(shared):
        folder = shared / 'we"ird run'
        run = check_ok(run_warm([*APP, *SMALL, LEDGER, f"hydra.run.dir='{folder}'", "resume=never"], timeout=300))
        assert not RESUMING.search(run.stdout), "resume=never must start from scratch"
        assert "RuntimeWarning" not in run.stderr, f"a rank or loader worker warned:\n{run.stderr[-3000:]}"
        assert (folder / "checkpoints" / "last.ckpt").exists() and len(list(folder.parent.iterdir())) == 1

    return made_once(tmp_path_factory, "reference", make) / 'we"ird run'


def _interrupt(hook: str, step: int, rank: int, sig: str, target: str, name: str = "interrupt") -> list[str]:
    """The app's arguments for a SignalAt callback named ``name`` (its marker: ``interrupted``, or
    ``interrupted-<name>`` for another name)."""
    prefix = f"+callbacks.{name}."
    marker = "interrupted" if name == "interrupt" else f"interrupted-{name}"
    return [f"{prefix}_target_=tests.helpers.interrupt.SignalAt", f"{prefix}hook={hook}", f"{prefix}step={step}",
            f"{prefix}rank={rank}", f"{prefix}sig={sig}", f"{prefix}target={target}",
            f"{prefix}marker={marker}"]  # fmt: skip


# Interrupted runs: each stop is resumed by the same command, the next interruption stops the resumed
# run, and the last launch runs to the end, bit-identical to the reference. Three are chained in one
# run, in the order they fire; a SIGTERM at the last step of an epoch runs on its own (in the chain,
# the validation after that step would take the USR1 too).
# scenario: [(hook, step, rank, signal, target), ...]
INTERRUPTIONS = {
    "group_sigterm_while_saving_then_group_ctrl_c_after_a_checkpoint_then_usr1_to_rank1_in_validation": [
        ("save_checkpoint", 2, 0, "SIGTERM", "group"),
        ("train_batch_start", 4, 0, "SIGINT", "group"),
        ("validation_batch_start", 0, 1, "SIGUSR1", "self"),
    ],
    "sigterm_to_rank1_at_the_last_step_of_an_epoch": [("train_batch_end", 8, 1, "SIGTERM", "self")],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario",
    # make test-e2e: the chain of three runs 115 s here, the last step's SIGTERM 60 s (make test proves
    # a SIGTERM to one rank in six phases through the library: tests/lightning/test_preemption_phases.py)
    [pytest.param(name, marks=pytest.mark.e2e) for name in INTERRUPTIONS],
)
def test_interrupted_runs_resume_and_end_bit_identical(scenario, reference, tmp_path):
    stops = INTERRUPTIONS[scenario]
    folder = tmp_path / "run"
    interrupts = [arg for i, spec in enumerate(stops) for arg in _interrupt(*spec, name=f"stop{i}")]
    # Each stop at the step after its signal (the default, "auto", checks about every half second,
    # which in these short epochs is often the epoch's end): the next interruption's step must come.
    exact = "callbacks.preemption.check_every_n_steps=1"
    cmd = [*APP, *SMALL, exact, f"hydra.run.dir={folder}", *interrupts]
    resume_from = None
    for i, (hook, _, _, sig, _) in enumerate(stops):
        before = set((folder / "checkpoints").glob("step-*-preempted.ckpt"))
        run = run_warm(cmd, timeout=300)
        gone = time.time()
        said = f"{sig} at {hook}\n{run.stdout[-2000:]}\n{run.stderr[-5000:]}"
        assert run.returncode == 128 + getattr(signal, sig), f"expected exit code {128 + getattr(signal, sig)}: {said}"
        sent = (folder / f"interrupted-stop{i}").stat().st_mtime
        assert gone - sent < 30, f"{sig} at {hook}: processes took {gone - sent:.1f} s to end after the signal"
        assert f"preempted by {sig}" in run.stderr and "Traceback" not in run.stderr, said
        if resume_from is not None:  # the same command continued from the last stop's checkpoint
            _assert_resumed_from(run, resume_from)
        stopped = set((folder / "checkpoints").glob("step-*-preempted.ckpt")) - before
        assert len(stopped) == 1, f"{sig} at {hook}: {sorted(p.name for p in (folder / 'checkpoints').iterdir())}"
        resume_from = stopped.pop()
        assert torch.load(resume_from, map_location="cpu", weights_only=True)["global_step"] == _step(resume_from)

    _assert_resumed_from(check_ok(run_warm(cmd, timeout=300)), resume_from)
    assert_equal_states(final_state(reference), final_state(folder))
    assert metrics_rows(folder) == metrics_rows(reference)


def _step(checkpoint: Path) -> int:
    return int(re.search(r"step-(\d+)", checkpoint.name).group(1))


def _assert_resumed_from(run: subprocess.CompletedProcess, checkpoint: Path) -> None:
    found = RESUMING.search(run.stdout)
    assert found and Path(found.group(1)) == checkpoint, run.stdout[-2000:]
    assert int(found.group(3)) == _step(checkpoint)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_stop_late_in_an_epoch_refuses_another_batch_size_and_at_the_epoch_end_any_layout_continues(
    reference, tmp_path
):
    """Issue 35: a stop at batch 7 of 8 of 2 ranks, past the whole epoch of 4 batches of 64 rows. The
    resume with ``data.batch_size=64`` is refused with one line (it trained the whole epoch again
    after the 7 batches); the same layout continues from batch 8, and after a stop at the epoch's
    end a run on 1 rank with batches of 16 trains the next epoch. By the row ledger of every run in
    the folder, each epoch trained the reference's rows, each as often as the reference did."""
    folder = tmp_path / "run"
    late = _interrupt("train_batch_start", 5, 0, "SIGTERM", "self", name="late")  # the stop after step 7
    end = _interrupt("train_batch_start", 7, 0, "SIGTERM", "self", name="end")  # at the last step: the epoch's end
    cmd = [*APP, *SMALL, LEDGER, "callbacks.preemption.check_every_n_steps=1", f"hydra.run.dir={folder}", *late, *end]
    stopped = run_warm(cmd, timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    (checkpoint,) = (folder / "checkpoints").glob("step-*-preempted.ckpt")
    per_epoch = len(batches_of(reference, rank=0, epoch=0))
    assert _step(checkpoint) == per_epoch - 1, f"not a stop at the epoch's last batch: {checkpoint.name}"

    refused = run_warm([*cmd, "data.batch_size=64"], timeout=300)
    line = _one_line_failure(refused, 2)
    assert f"(batch {per_epoch - 1} of {per_epoch} of epoch 0)" in line and "batch_size 32 -> 64" in line, line
    assert refused.stderr.strip() == line, f"decided before any rank or banner starts:\n{refused.stderr}"

    stopped = run_warm(cmd, timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    _assert_resumed_from(stopped, checkpoint)
    at_end = folder / "checkpoints" / f"step-{per_epoch}-preempted.ckpt"
    resumed = check_ok(run_warm([*cmd, "trainer.devices=1", "data.batch_size=16"], timeout=300))
    _assert_resumed_from(resumed, at_end)
    assert RESUMING.search(resumed.stdout).group(0) + " on 1 rank (was 2)" in resumed.stdout, resumed.stdout[-2000:]
    trained, expected = rows_per_epoch(folder), rows_per_epoch(reference)
    assert sorted(trained) == sorted(expected), (sorted(trained), sorted(expected))
    for epoch, rows in expected.items():
        twice, never = trained[epoch] - rows, rows - trained[epoch]
        assert not twice and not never, (
            f"epoch {epoch}: {sum(twice.values())} rows too many, {sum(never.values())} missing"
        )


@pytest.mark.e2e
@pytest.mark.slow
def test_resume_never_starts_over_and_a_path_resumes_from_it(reference, tmp_path):
    folder = tmp_path / "run"
    cmd = [*APP, *SMALL, f"hydra.run.dir={folder}"]
    stopped = run_warm([*cmd, *_interrupt("train_batch_end", 5, 0, "SIGTERM", "self")], timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    checkpoint = next((folder / "checkpoints").glob("step-*-preempted.ckpt"))
    other = tmp_path / "other"
    resumed = check_ok(run_warm([*APP, *SMALL, f"hydra.run.dir={other}", f"resume={checkpoint}"], timeout=300))
    assert RESUMING.search(resumed.stdout).group(1) == str(checkpoint)
    assert_equal_states(final_state(reference), final_state(other))
    # resume=never where checkpoints are: refused (the two runs' files would mix). In a new folder it
    # starts over: the reference ran so.
    refused = run_warm([*cmd, "resume=never"], timeout=300)
    assert refused.returncode == 2 and refused.stderr.strip() == (
        f"error: resume got 'never', but {folder / 'checkpoints'} holds the checkpoints of an earlier run,"
        " allowed: 'auto' to continue that run, or resume=never with a new hydra.run.dir"
    ), refused.stderr[-3000:]


@pytest.mark.parametrize(
    ("name", "content", "why"),
    [
        ("nowhere.ckpt", None, "no such file"),
        ("config.yaml", b"trainer:\n  max_epochs: 3\n", "does not load with weights_only=True: not a zip archive"),
        ("weights.ckpt", "state_dict", "not a Lightning checkpoint (no state_dict)"),
        ("model.ckpt", "state_dict only", "not a Lightning checkpoint (a state_dict without loops"),
    ],
    ids=["missing", "a YAML file", "a bare state_dict", "a state_dict under its key"],
)
def test_bad_resume_is_a_one_line_error(tmp_path, name, content, why):
    if content == "state_dict":
        torch.save({"features.0.weight": torch.ones(2)}, tmp_path / name)
    elif content == "state_dict only":  # `torch.save({"state_dict": model.state_dict()}, ...)`
        torch.save({"state_dict": {"features.0.weight": torch.ones(2)}}, tmp_path / name)
    elif content is not None:
        (tmp_path / name).write_bytes(content)
    result = run_warm([*APP, f"resume={name}", "hydra.run.dir=run"], timeout=60, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().startswith(f"error: resume got '{name}' ({why}"), result.stderr
    assert result.stderr.strip().endswith("allowed: 'auto', 'never' or the path of a checkpoint file"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists(), "a refused run writes no folder"


def test_an_unverified_checkpoint_that_does_not_fit_is_one_line(tmp_path):
    """Past the up-front check (a Lightning layout, no digest): the refusal is still the only line."""
    torch.save({"state_dict": {"features.0.weight": torch.ones(2)}, "loops": {}}, tmp_path / "other.ckpt")
    result = run_warm([*APP, "resume=other.ckpt", "hydra.run.dir=run"], timeout=60, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().startswith("error: resume other.ckpt does not fit the model"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.slow
@pytest.mark.e2e  # 70 s here: make test-e2e; make test keeps torchrun's elastic restart (test_exact_epochs.py)
def test_torchrun_restarts_the_group_after_a_worker_is_killed_and_it_resumes(reference, tmp_path):
    """SIGKILL of rank 1 mid-epoch: torchrun restarts both workers, which find the run folder
    (named from the rendezvous id) and continue from its newest checkpoint."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=exp7",
        "-m", "ddp_plugins.train", "trainer.devices=2", *SMALL,
        *_interrupt("train_batch_end", 5, 1, "SIGKILL", "self"),
    ]  # fmt: skip
    result = check_ok(run_command(cmd, timeout=240, cwd=tmp_path))
    folder = tmp_path / "outputs" / "torchrun-exp7"
    assert (folder / "interrupted").read_text().startswith("SIGKILL"), "the worker was not killed"
    found = RESUMING.search(result.stdout)
    assert found, f"the restarted group did not resume:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert Path(found.group(1)).parent == folder / "checkpoints" and int(found.group(3)) == 4
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["torchrun-exp7"], "one run folder"
    assert_equal_states(final_state(reference), final_state(folder))
    assert metrics_rows(folder) == metrics_rows(reference)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_usr1_requeues_the_job_and_it_resumes_by_itself(slurm_cluster, reference, tmp_path):
    """`scancel --signal=USR1` (what `--signal=USR1@90` sends before preemption) on a `--requeue`
    job: every task stops at one step and checkpoints, the job requeues itself, and the requeued
    job continues in its own folder (outputs/slurm-<job id>) to the reference's end state."""
    # Every task holds after step 3 until Slurm's USR1 has reached it (AwaitSignal), and the ranks agree
    # on it at the next step: the signal lands mid-training however fast the job trains (it once came
    # after the last step, and the job had finished).
    hold = ["+callbacks.await_signal._target_=tests.helpers.interrupt.AwaitSignal",
            "callbacks.preemption.check_every_n_steps=1"]  # fmt: skip
    srun = f"srun {sys.executable} -m ddp_plugins.train trainer.devices=2 {' '.join([*SMALL, *hold])}"
    job, folder = submit_requeue_job(tmp_path, "ddp-preempt", srun, loopback_env())
    try:
        deadline = time.monotonic() + 240
        while not (folder / "awaiting-signal").exists():
            assert time.monotonic() < deadline, f"job {job} did not reach step 3: {job_fields(job)}"
            time.sleep(0.3)
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
        released = False
        while (fields := job_fields(job)).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            assert time.monotonic() < deadline + 240, f"job {job} did not end: {fields}"
            released = released or release_when_requeued(job, fields)
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], timeout=30)
    fields = job_fields(job)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{fields}\n{log[-3000:]}"
    found = RESUMING.findall(log)  # the requeued job's log (Slurm truncates it on requeue)
    assert len(found) == 1, f"one resume, printed once:\n{log[-3000:]}"
    stop = Path(found[0][0])
    assert stop.parent == folder / "checkpoints" and re.fullmatch(r"step-\d+-preempted\.ckpt", stop.name), stop
    assert 3 < _step(stop) < 16, f"{stop.name}: not a stop after the signal (step 3) and before the last step (16)"
    assert_equal_states(final_state(reference), final_state(folder))
    assert metrics_rows(folder) == metrics_rows(reference)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.slurm
def test_submitit_sweep_job_requeued_by_its_signal_resumes_in_its_job_folder(slurm_cluster, reference, tmp_path):
    """`-m hydra/launcher=submitit_slurm`: each sweep job is a 2-task DDP job. submitit's USR2
    (`--signal=USR2@<delay>`, before the time limit) to the first job mid-epoch: both tasks stop at
    one step, the job requeues itself, and the requeued job resumes in its own sweep folder and ends
    as the reference did; the multirun returns 0 after both jobs. Rank 0 tears down 2 s slower
    (SlowStop), as on a loaded machine: the window where Slurm's SIGTERM for the requeue reached
    Lightning's handler, whose broadcast replaced the stop with a gloo error (line and code lost)."""
    sweep = tmp_path / "multirun"
    small = [arg for arg in SMALL if not arg.startswith("model.dropout=")]
    cmd = [*APP, "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={sweep}",
           "hydra.launcher.timeout_min=10", "trainer.devices=2", *small, "model.dropout=0.2,0.1",
           "+callbacks.slow._target_=tests.helpers.interrupt.SlowStop"]  # fmt: skip
    multirun = subprocess.Popen(cmd, cwd=tmp_path, env=loopback_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
    job = None
    try:
        deadline = time.monotonic() + 240
        while not list((sweep / "0" / "checkpoints").glob("step-*.ckpt")):
            assert multirun.poll() is None and time.monotonic() < deadline, "the first sweep job wrote no checkpoint"
            time.sleep(0.3)
        job = next(p.name for p in (sweep / ".submitit").iterdir() if p.name.endswith("_0"))  # <array job>_0
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
        released = False
        while multirun.poll() is None:
            assert time.monotonic() < deadline + 240, f"the sweep did not end: {job_fields(job)}"
            released = released or release_when_requeued(job, job_fields(job))
            time.sleep(0.5)
        out = multirun.stdout.read()
        assert multirun.returncode == 0, out[-3000:]
        while (fields := job_fields(job)).get("JobState") in ("RUNNING", "COMPLETING"):  # Slurm catches up
            assert time.monotonic() < deadline + 300, fields
            time.sleep(0.3)
    finally:
        if multirun.poll() is None:
            os.killpg(multirun.pid, signal.SIGKILL)
        if job:
            subprocess.run(["scancel", job.split("_")[0]], timeout=30)
    logs = "".join(p.read_text() for p in sorted((sweep / ".submitit" / job).glob("*_0_log.*")))
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{fields}\n{logs}"
    assert "preempted by SIGUSR2 (exit code 140)" in logs, f"{logs}\n{slurm_cluster.log_tail()}"
    assert "Caught signal SIGUSR2" not in logs, "submitit's handler (requeue from inside the handler) must not run"
    # Slurm's SIGTERM for the requeue meets our handlers in a rank that tears down, never Lightning's
    assert "Received SIGTERM" not in logs, f"Lightning's SIGTERM handler ran in a stopping rank:\n{logs}"
    found = RESUMING.findall(logs)
    assert len(found) == 1 and Path(found[0][0]).parent == sweep / "0" / "checkpoints", logs[-3000:]
    assert re.fullmatch(r"step-\d+-preempted\.ckpt", Path(found[0][0]).name), "resumed from the stop, no step lost"
    assert_equal_states(final_state(reference), final_state(sweep / "0"))
    assert metrics_rows(sweep / "0") == metrics_rows(reference)
    assert (sweep / "1" / "checkpoints" / "last.ckpt").exists(), "the second sweep job ran to its end"


@pytest.mark.slow
@pytest.mark.e2e
def test_a_second_run_in_a_busy_run_folder_is_refused(tmp_path):
    """Two jobs in one folder would interleave checkpoints and resume each other's: the second is
    refused before Hydra writes anything there (the running job's .hydra/ record stays its own).
    The running job has one rank: the launcher holds the folder's lock, whatever the world size."""
    folder = tmp_path / "run"
    cmd = [*APP, *SMALL, f"hydra.run.dir={folder}"]
    first = subprocess.Popen([*cmd, "trainer.max_epochs=1000", "trainer.devices=1"], cwd=REPO_ROOT, env=loopback_env(),
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (folder / "checkpoints").exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.2)
        record = {p.name: p.read_bytes() for p in (folder / ".hydra").iterdir()}
        second = run_warm([*cmd, "model.lr=0.01"], timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert {p.name: p.read_bytes() for p in (folder / ".hydra").iterdir()} == record, (
            "the refused run wrote .hydra/"
        )
        assert re.fullmatch(
            rf"error: hydra.run.dir {re.escape(str(folder))} is in use by a running job \(PID {first.pid}\),"
            r" allowed: a folder no running job writes to",
            second.stderr.strip(),
        ), second.stderr
        assert first.poll() is None, "the first run is still training"
        os.killpg(first.pid, signal.SIGTERM)
        assert first.wait(timeout=60) == 128 + signal.SIGTERM, first.stderr.read()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_sigterm_at_the_last_step_ends_as_a_finished_run_and_a_rerun_says_so(reference, tmp_path):
    folder = tmp_path / "run"
    exact = "callbacks.preemption.check_every_n_steps=1"
    # sent as the last batch starts (global step 15 of 16): the stop is agreed at the last step
    cmd = [*APP, *SMALL, exact, f"hydra.run.dir={folder}", *_interrupt("train_batch_start", 15, 1, "SIGTERM", "self")]
    run = check_ok(run_warm(cmd, timeout=300))  # exit 0: training and its final validation were done
    assert (folder / "interrupted").exists(), "the SIGTERM was not sent"
    assert "came at the last step: the run is complete" in run.stderr, run.stderr[-3000:]
    final = re.search(r"final validation accuracy: ([0-9.]+)", run.stdout)
    assert final, run.stdout[-2000:]
    assert_equal_states(final_state(reference), final_state(folder))
    rerun = check_ok(run_warm(cmd, timeout=120))
    assert f"already finished at epoch 1 (accuracy {final.group(1)}" in rerun.stdout, rerun.stdout[-2000:]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_tensorboard_run_killed_then_preempted_resumes_into_one_event_stream(tmp_path):
    """Issue 35: ``logger=tensorboard`` resumes as the CSV does. A launch killed outright at step 7
    (its last checkpoint: step 4), the same command resumed and stopped by a SIGTERM in epoch 1, and
    resumed again to the end: TensorBoard shows the uninterrupted run's scalars (tag, step, value),
    each once. The folder holds the three launches' event files; each starts with a restart marker
    at the step it continued from, which drops what the killed launch logged after step-4.ckpt."""
    # Step checkpoints every 4 steps: the killed launch logs steps 4 to 6 past its last one
    # (tensorboardX writes from a thread, so the very last step may not reach the file before a kill)
    config = [*SMALL, "checkpoint.every_n_train_steps=4", "callbacks.preemption.check_every_n_steps=1"]
    reference = tmp_path / "reference"
    check_ok(run_warm([*APP, *config, "logger=tensorboard", f"hydra.run.dir={reference}"], timeout=300))
    folder = tmp_path / "run"
    kill = _interrupt("train_batch_start", 7, 0, "SIGKILL", "group", name="kill")
    stop = _interrupt("train_batch_start", 11, 0, "SIGTERM", "self", name="stop")
    cmd = [*APP, *config, "logger=tensorboard", f"hydra.run.dir={folder}", *kill, *stop]
    killed = run_warm(cmd, timeout=300)
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), killed.stderr[-3000:]
    (first,) = event_files(folder / "tensorboard")
    assert max(s.step for s in read_event_file(first).scalars) >= 5, "nothing logged after the step-4 checkpoint"

    stopped = run_warm(cmd, timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    _assert_resumed_from(stopped, folder / "checkpoints" / "step-4.ckpt")
    (preempted,) = (folder / "checkpoints").glob("step-*-preempted.ckpt")
    _assert_resumed_from(check_ok(run_warm(cmd, timeout=300)), preempted)

    launches = [read_event_file(path) for path in event_files(folder / "tensorboard")]
    assert [launch.starts for launch in launches] == [[0], [4], [_step(preempted)]], [f.path for f in launches]
    assert all(launch.scalars for launch in launches), "a launch's events are missing"
    expected = scalar_series(reference / "tensorboard")
    assert expected and scalar_series(folder / "tensorboard") == expected
