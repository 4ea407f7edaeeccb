"""What a file, a kill or a full disk can do to a run, through the real app and real ranks.

A crafted checkpoint runs nothing; damaged checkpoints are skipped and the run continues from the
newest valid one, ending as a run resumed from that one by path (from a copy without its digest,
which continues unverified with one line); a hard kill with the default
config loses at most the epoch under way; a full disk, a read-only folder and a checkpoint of
another model each end in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ddp_plugins.core.checkpoints import digest_path, verify_checkpoint
from ddp_plugins.testing import check_ok, free_port, loopback_env
from tests.helpers.runs import assert_equal_states, final_state
from tests.helpers.shared import made_once
from tests.helpers.warm import APP, run_warm

SMALL = [
    "data=synthetic", "data.num_samples=640", "model.channels=8", "data.num_workers=0",
    "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1",
]  # fmt: skip  # 512 training rows: 8 steps per epoch on 2 ranks
STEPS = ["checkpoint.every_n_train_steps=2", "checkpoint.keep=2"]
RESUMING = re.compile(r"resuming from (\S+) \(epoch (\d+), step (\d+)\)")


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _one_line_failure(result: subprocess.CompletedProcess, code: int) -> str:
    """The one error line of a run that failed with ``code`` and printed no traceback."""
    assert result.returncode == code, f"exit {result.returncode}, expected {code}\n{result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    errors = _error_lines(result.stderr)
    assert len(errors) == 1, result.stderr[-4000:]
    return errors[0]


class _Payload:
    """A pickle that creates a file when it is loaded: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _write_crafted(path: Path, marker: Path) -> None:
    with open(path, "wb") as file:
        pickle.dump({"epoch": 0, "global_step": 5, "state_dict": _Payload(marker)}, file)


@pytest.fixture(scope="session")
def one_epoch(tmp_path_factory):
    """A finished 1-epoch run with step checkpoints: step-6, step-8, last and the best (both step 8)."""

    def make(shared):
        folder = shared / "run"
        check_ok(run_warm([*APP, *SMALL, *STEPS, "trainer.max_epochs=1", f"hydra.run.dir={folder}"], timeout=300))
        names = sorted(p.name for p in (folder / "checkpoints").glob("*.ckpt"))
        assert names == ["epoch=0-step=8.ckpt", "last.ckpt", "step-6.ckpt", "step-8.ckpt"], names

    return made_once(tmp_path_factory, "one_epoch", make) / "run"


@pytest.mark.slow
def test_a_crafted_checkpoint_runs_nothing(one_epoch, tmp_path):
    marker = tmp_path / "code-ran"
    crafted = tmp_path / "step-5.ckpt"
    _write_crafted(crafted, marker)

    # an explicit path: refused before any process starts
    result = run_warm([*APP, *SMALL, f"resume={crafted}", f"hydra.run.dir={tmp_path / 'a'}"], timeout=120)
    line = _one_line_failure(result, 2)
    assert line.startswith(f"error: resume got '{crafted}' (does not load with weights_only=True"), line
    assert not (tmp_path / "a").exists(), "a refused run writes no folder"

    # its own digest beside it does not help: it does not load with weights_only=True
    digest = hashlib.sha256(crafted.read_bytes()).hexdigest()
    digest_path(crafted).parent.mkdir(exist_ok=True)
    digest_path(crafted).write_text(f"{digest}  {crafted.name}\n")
    result = run_warm([*APP, *SMALL, f"resume={crafted}", f"hydra.run.dir={tmp_path / 'b'}"], timeout=120)
    assert "does not load with weights_only=True" in _one_line_failure(result, 2)

    # placed in a run folder with resume=auto (and a forged digest, the newest write): one line, exit 2
    folder = tmp_path / "run"
    shutil.copytree(one_epoch, folder)
    shutil.copy(crafted, folder / "checkpoints" / "step-9.ckpt")
    digest_path(folder / "checkpoints" / "step-9.ckpt").write_text(f"{digest}  step-9.ckpt\n# write 99\n")
    result = run_warm([*APP, *SMALL, *STEPS, "trainer.max_epochs=2", f"hydra.run.dir={folder}"], timeout=120)
    assert "does not load with weights_only=True" in _one_line_failure(result, 2)
    assert not marker.exists(), "the crafted checkpoint's code ran"


@pytest.mark.slow
@pytest.mark.e2e
def test_damaged_checkpoints_are_skipped_and_the_run_ends_as_one_resumed_from_the_newest_valid(one_epoch, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(one_epoch, damaged)
    ckpts = damaged / "checkpoints"
    # every checkpoint of step 8 damaged a different way: truncated, random bytes, garbage mid-file
    half = (ckpts / "last.ckpt").read_bytes()
    (ckpts / "last.ckpt").write_bytes(half[: len(half) // 2])
    (ckpts / "step-8.ckpt").write_bytes(os.urandom(len(half)))
    with open(ckpts / "epoch=0-step=8.ckpt", "r+b") as file:
        file.seek(len(half) // 2)
        file.write(os.urandom(4096))
    (ckpts / ".step-10.ckpt.4242.tmp").write_bytes(b"what a kill during a write leaves")

    resumed = check_ok(
        run_warm([*APP, *SMALL, *STEPS, "trainer.max_epochs=2", f"hydra.run.dir={damaged}"], timeout=300)
    )
    skipped = re.findall(r"resume: skipped (\S+) \((.*)\)", resumed.stderr)
    assert sorted(Path(p).name for p, _ in skipped) == ["epoch=0-step=8.ckpt", "last.ckpt", "step-8.ckpt"], skipped
    assert all(why.startswith("damaged: its SHA-256 does not match") for _, why in skipped), skipped
    found = RESUMING.search(resumed.stdout)
    assert found and Path(found.group(1)) == ckpts / "step-6.ckpt", resumed.stdout[-2000:]
    assert not (ckpts / ".step-10.ckpt.4242.tmp").exists(), "a temporary file a kill left is removed at start"

    # The same point resumed by path, from a copy without its digest (a checkpoint of an earlier
    # version): it continues unverified, with one line saying so, and ends where the damaged folder did
    legacy = tmp_path / "legacy" / "step-6.ckpt"
    legacy.parent.mkdir()
    shutil.copyfile(one_epoch / "checkpoints" / "step-6.ckpt", legacy)
    by_path = tmp_path / "by_path"
    unverified = check_ok(run_warm([*APP, *SMALL, *STEPS, "trainer.max_epochs=2", f"hydra.run.dir={by_path}",
                                       f"resume={legacy}"], timeout=300))  # fmt: skip
    assert RESUMING.search(unverified.stdout).group(1) == str(legacy)
    assert f"resume: {legacy} is not verified (no digest" in unverified.stderr
    assert_equal_states(final_state(by_path), final_state(damaged))
    assert "weights_only" not in resumed.stderr, "a resume prints no weights_only warnings"


@pytest.mark.slow
@pytest.mark.e2e
def test_a_hard_kill_with_the_default_config_loses_at_most_the_epoch_under_way(tmp_path):
    folder = tmp_path / "run"
    cmd = [*APP, *SMALL, "trainer.max_epochs=6", f"hydra.run.dir={folder}"]
    kill = ["+callbacks.kill._target_=tests.helpers.interrupt.SignalAt", "+callbacks.kill.hook=train_batch_start",
            "+callbacks.kill.step=38", "+callbacks.kill.sig=SIGKILL", "+callbacks.kill.target=group"]  # fmt: skip
    killed = run_warm([*cmd, *kill], timeout=300)  # SIGKILL to every rank at step 38: epoch 4 of 0..5
    assert killed.returncode == -9, f"exit {killed.returncode}\n{killed.stderr[-3000:]}"
    resumed = check_ok(run_warm(cmd, timeout=300))
    found = RESUMING.search(resumed.stdout)
    assert found, resumed.stdout[-2000:]
    assert int(found.group(3)) == 32, f"resumed at step {found.group(3)}: more than the epoch under way was lost"
    assert final_state(folder)["global_step"] == 48, "the final state is on disk at the end"


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_one_line(one_epoch, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(one_epoch, folder)
    result = run_warm(
        [*APP, *SMALL, "model.channels=16", "trainer.max_epochs=2", f"hydra.run.dir={folder}"], timeout=120
    )
    line = _one_line_failure(result, 2)
    assert re.fullmatch(
        r"error: resume \S+ does not fit the model: (\S+) has shape \(\d+(, \d+)*\) in the checkpoint and"
        r" \(\d+(, \d+)*\) in the model, allowed: .*", line
    ), line  # fmt: skip


@contextlib.contextmanager
def _tmpfs(where: Path, options: str):
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_full_disk_is_one_line_naming_the_file(tmp_path):
    with _tmpfs(tmp_path / "small", "size=48k") as small:
        folder = small / "run"
        result = run_warm([*APP, *SMALL, "trainer.max_epochs=1", f"hydra.run.dir={folder}"], timeout=300)
        line = _one_line_failure(result, 1)
        assert re.fullmatch(
            rf"error: cannot write checkpoint {re.escape(str(folder))}/checkpoints/\S+\.ckpt: no space left on device",
            line,
        ), line
        assert not [p for p in (folder / "checkpoints").iterdir() if p.name.endswith(".tmp")], "no temporary file left"


def test_a_read_only_run_folder_is_one_line(tmp_path):
    with _tmpfs(tmp_path / "ro", "ro,size=16k") as ro:
        result = run_warm([*APP, *SMALL, f"hydra.run.dir={ro / 'run'}"], timeout=120)
        line = _one_line_failure(result, 2)
        assert line == (
            f"error: hydra.run.dir {ro / 'run'} cannot be written (Read-only file system),"
            " allowed: a folder this user can write to"
        ), line


@pytest.mark.slow
def test_a_rendezvous_for_a_node_that_never_comes_gives_up_within_the_timeout_with_one_line(tmp_path):
    env = loopback_env(NODE_RANK="0", MASTER_PORT=str(free_port()))
    start = time.monotonic()
    cmd = [*APP, *SMALL, "trainer.num_nodes=2", "strategy.timeout=10", f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_warm(cmd, timeout=120, env=env, warm_children=False)  # a start-up proof: rank 1 starts fresh
    elapsed = time.monotonic() - start
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    # 2 of 4 (this node's ranks): 1 where rank 1 was still starting at the timeout on a loaded machine
    expected = (
        r"^error: the 4 ranks did not all meet at 127\.0\.0\.1:\d+ within the timeout \(10 s\): .*[12]/4 clients joined"
    )
    assert re.search(expected, result.stderr, re.MULTILINE), result.stderr[-3000:]
    assert elapsed < 60, f"{elapsed:.0f} s to give up on a 10 s rendezvous timeout"


@pytest.mark.slow
def test_checkpoints_of_an_earlier_version_without_digests_are_not_dropped_silently(one_epoch, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(one_epoch, folder)
    shutil.rmtree(digest_path(folder / "checkpoints" / "last.ckpt").parent)  # the folder of every sidecar
    cmd = [*APP, *SMALL, *STEPS, "trainer.max_epochs=2", f"hydra.run.dir={folder}"]
    refused = run_warm(cmd, timeout=120)  # auto would otherwise start over and lose the run
    line = _one_line_failure(refused, 2)
    assert "no checkpoint in" in line and "verifies" in line and "last.ckpt: no digest" in line, line
    # resume=<one of them> continues unverified: the damaged-checkpoints test resumes so


def _listing(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (folder / "checkpoints").iterdir()}


@pytest.mark.slow
def test_a_finished_run_says_so_and_a_lower_max_epochs_is_one_line(one_epoch, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(one_epoch, folder)
    before = _listing(folder)
    rerun = check_ok(run_warm([*APP, *SMALL, *STEPS, "trainer.max_epochs=1", f"hydra.run.dir={folder}"], timeout=120))
    last = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    accuracy = next(s["current_score"] for s in last["callbacks"].values() if s.get("monitor") == "val/exact_acc")
    assert f"already finished at epoch 0 (accuracy {float(accuracy):.4f}" in rerun.stdout, rerun.stdout[-2000:]
    assert "resuming from" not in rerun.stdout and "GPU available" not in rerun.stderr + rerun.stdout, "nothing starts"
    assert _listing(folder) == before, "a finished run's rerun writes no checkpoint"
    lower = run_warm([*APP, *SMALL, *STEPS, "trainer.max_epochs=0", f"hydra.run.dir={folder}"], timeout=120)
    line = _one_line_failure(lower, 2)
    assert line.startswith("error: trainer.max_epochs got 0, fewer than the 1 epochs"), line
    assert len(lower.stderr.strip().splitlines()) == 1, f"the refusal comes before any banner:\n{lower.stderr}"


def _sidecar_by_hand(checkpoint: Path) -> None:
    """What `sha256sum last.ckpt > last.ckpt.sha256` writes: a true digest, no write number."""
    digest = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    digest_path(checkpoint).write_text(f"{digest}  {checkpoint.name}\n")


@pytest.mark.slow
@pytest.mark.parametrize("sidecar", ["garbled", "by hand"])
def test_a_checkpoint_passed_over_for_its_digest_is_named(one_epoch, tmp_path, sidecar):
    folder = tmp_path / "run"
    shutil.copytree(one_epoch, folder)
    newest = folder / "checkpoints" / "last.ckpt"
    if sidecar == "garbled":
        digest_path(newest).write_bytes(os.urandom(64))
    else:
        _sidecar_by_hand(newest)
    os.utime(newest)  # the newest file of the folder, whatever its sidecar says
    run = check_ok(run_warm([*APP, *SMALL, *STEPS, "trainer.max_epochs=1", f"hydra.run.dir={folder}"], timeout=300))
    named = [line for line in run.stderr.splitlines() if "resume: skipped" in line and str(newest) in line]
    assert len(named) == 1, f"last.ckpt was passed over without a line:\n{run.stderr[-3000:]}"
    assert ("holds no SHA-256" if sidecar == "garbled" else "no write number") in named[0], named[0]


@pytest.mark.slow
def test_when_every_checkpoint_is_damaged_the_run_refuses_and_overwrites_nothing(one_epoch, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(one_epoch, folder)
    for checkpoint in (folder / "checkpoints").glob("*.ckpt"):
        digest_path(checkpoint).write_text("0" * 64 + f"  {checkpoint.name}\n# write 1\n")
    before = _listing(folder)
    refused = run_warm([*APP, *SMALL, *STEPS, "trainer.max_epochs=2", f"hydra.run.dir={folder}"], timeout=120)
    line = _one_line_failure(refused, 2)
    for name in ("epoch=0-step=8.ckpt", "last.ckpt", "step-6.ckpt", "step-8.ckpt"):
        assert f"{name}: damaged" in line, line
    assert _listing(folder) == before, "a refused run must leave every checkpoint as it was"


@pytest.mark.e2e
@pytest.mark.waits
@pytest.mark.slow
def test_a_stopped_rank_is_named_within_a_minute_with_the_default_settings(tmp_path):
    """SIGSTOP freezes rank 1 in the middle of an epoch: with the default strategy.timeout (30 minutes)
    the job would wait silently; the liveness room names rank 1 at the default naming limit (30 s) and
    ends every rank at the end limit (300 s by default, 40 s here)."""
    folder = tmp_path / "run"
    stop = ["+callbacks.freeze._target_=tests.helpers.interrupt.SignalAt", "+callbacks.freeze.hook=train_batch_start",
            "+callbacks.freeze.step=20", "+callbacks.freeze.rank=1", "+callbacks.freeze.sig=SIGSTOP"]  # fmt: skip
    cmd = [*APP, *SMALL, "trainer.max_epochs=3", f"hydra.run.dir={folder}", "strategy.stall_end_after=40", *stop]
    result = run_warm(cmd, timeout=240)  # returns once every process that held its output has ended
    took = time.time() - (folder / "interrupted").stat().st_mtime
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-4000:]
    named, ended = _error_lines(result.stderr)
    # its last known step: what it published last, at most the step it froze at
    found = re.match(r"error: rank 1 \(PID \d+ on \S+, [a-z (_)]+ \(global step (\d+)\)\)", named)
    assert found and 1 <= int(found.group(1)) <= 20, f"not rank 1 at a step up to the one it froze at (20): {named}"
    assert "its process is stopped (SIGSTOP or a debugger) for 3" in named, named  # named at 30 to 39 s
    assert 40 <= took < 60, f"the job ended {took:.0f} s after rank 1 froze, not at the 40 s end limit"
    assert len(result.stderr.strip().splitlines()) < 40, result.stderr[-3000:]
    dump = (folder / "stall.txt").read_text()
    assert "rank 1 (PID" in dump and "rank 0 (PID" in dump and "Traceback" not in dump, dump
    # rank 0 wrote the last completed step while it waited: the same command resumes from it, to the end
    (rescue,) = (folder / "checkpoints").glob("step-*-stalled.ckpt")
    assert ended == f"error: ending every rank; checkpoint of the last completed step: {rescue}", ended
    assert verify_checkpoint(rescue) is None, "the rescue checkpoint is whole, with its digest"
    resumed = check_ok(run_warm(cmd, timeout=240))  # the freeze fires once per run folder
    assert RESUMING.search(resumed.stdout).group(1) == str(rescue), resumed.stdout[-2000:]
    assert final_state(folder)["global_step"] == 24, "3 epochs of 8 steps"


@pytest.mark.e2e
@pytest.mark.waits
@pytest.mark.slow
@pytest.mark.timeout(720)
@pytest.mark.parametrize(
    ("where", "rank"), [("epoch_end", 0), ("first_step", 1)], ids=["rank-zero-callback", "first-step"]
)
def test_one_rank_working_past_the_default_end_limit_is_named_once_and_the_job_finishes(where, rank, tmp_path):
    """Issue 50, with the app's defaults (named at 30 s, a stopped rank ended at 300 s): one rank alone works
    330 s while the other waits for it: rank 0 at the end of the first epoch, as a rank-zero-only callback
    does, or rank 1 before its first step (a compile, a cold cache). a1c30de ended both jobs at about 300 s;
    a rank whose process runs is named at most once, never another rank, and never ended by default."""
    work = ["+callbacks.work._target_=tests.helpers.interrupt.WorkAt", "+callbacks.work.seconds=330",
            f"+callbacks.work.rank={rank}", f"+callbacks.work.where={where}"]  # fmt: skip
    folder = tmp_path / "run"
    done = check_ok(run_warm([*APP, *SMALL, "trainer.max_epochs=2", f"hydra.run.dir={folder}", *work], timeout=660))
    named = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(named) <= 1, done.stderr[-3000:]
    for line in named:
        assert line.startswith(f"error: rank {rank} (PID "), line
        assert "; the job goes on (a rank whose process runs is not ended)" in line, line
    if where == "epoch_end":  # the other rank waits in a collective the room sees: it is named
        assert named, done.stderr[-3000:]
    # "progress again" needs one more judgement (an interval of 5 s at the defaults) before the fit ends: not asked
    assert (folder / "worked").exists() and final_state(folder)["global_step"] == 16, "2 epochs of 8 steps"


@pytest.mark.slow
@pytest.mark.parametrize("rank", [pytest.param(0, marks=pytest.mark.e2e), 1])  # rank 0's: make test-e2e
def test_a_rank_that_raises_shows_its_traceback_once_and_no_peer_is_blamed(rank, tmp_path):
    """Issue 53: a failure printed its traceback 2 to 3 times. Rank ``rank`` raises in a callback at step 3:
    the job's stderr (the launcher's and the child rank's) holds that traceback once; the only other
    line about it names the rank that raised (never a peer), and every process exits 1."""
    raising = ["+callbacks.boom._target_=tests.helpers.interrupt.RaiseAt", "+callbacks.boom.step=3",
               f"+callbacks.boom.rank={rank}"]  # fmt: skip
    done = run_warm([*APP, *SMALL, *raising, f"hydra.run.dir={tmp_path / 'run'}"], timeout=180)
    assert done.returncode == 1, f"exit code {done.returncode}:\n{done.stderr[-3000:]}"
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr[-6000:]
    assert done.stderr.count(f"ValueError: boom on rank {rank}") >= 1, done.stderr[-3000:]
    blamed = re.findall(r"error: rank (\d+) \(PID", done.stderr)
    assert set(blamed) <= {str(rank)}, f"a peer was blamed for rank {rank}'s error: {blamed}"
