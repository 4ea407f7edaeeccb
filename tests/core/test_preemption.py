"""The torch-only preemption pieces: signal flags, agreement, exit codes, run names, checkpoint helpers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_plugins.core import (
    Preempted,
    ResumableSampler,
    SignalAgreement,
    SignalFlag,
    agree_on_signal,
    gather_per_rank,
    latest_checkpoint,
    save_atomic,
    stable_run_name,
)
from ddp_plugins.core.checkpoints import (
    digest_path,
    newest_valid_checkpoint,
    remove_checkpoint_file,
    save_checkpoint_file,
    write_number,
)
from ddp_plugins.core.files import count_csv_rows, truncate_csv_rows
from ddp_plugins.core.preemption import check_signals, restart_scoped_store, slurm_job_id, submitit_signal


def test_check_signals_names_numbers_and_clear_errors():
    assert check_signals(["term", "SIGUSR1", int(signal.SIGINT), "SIGTERM"]) == (
        signal.SIGTERM, signal.SIGUSR1, signal.SIGINT,
    )  # fmt: skip
    for bad in (["SIGKILL"], ["SIGSTOP"], ["NOPE"], [1.5], [True]):
        with pytest.raises(ValueError, match="`signals` should be signal names that can be caught"):
            check_signals(bad)
    with pytest.raises(TypeError, match="`signals` should be a list of signal names"):
        check_signals("SIGTERM")


def test_signal_flag_records_the_first_signal_and_restores_the_previous_handler():
    previous = signal.getsignal(signal.SIGUSR2)
    flag = SignalFlag(["SIGUSR2", "SIGHUP"]).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGUSR2)  # a repeated SIGUSR2 (forwarded twice) does not kill
        assert flag.signum == signal.SIGUSR2
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGUSR2) == previous


def _script(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=60)


def test_a_second_ctrl_c_ends_the_process_at_once():
    """A repeated SIGINT less than a second after the first (by the flag's clock) is the same press;
    one a second after it ends the process before the next line runs."""
    result = _script(
        """
        import os, signal
        from ddp_plugins.core import SignalFlag
        now = [100.0]
        flag = SignalFlag(clock=lambda: now[0]).install()
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.signum == signal.SIGINT
        now[0] += 0.999
        os.kill(os.getpid(), signal.SIGINT)  # within the second: taken as the same press
        print("alive after the repeat", flush=True)
        now[0] += 0.001
        os.kill(os.getpid(), signal.SIGINT)  # a second press: the process ends now
        print("still alive", flush=True)
        """
    )
    assert result.returncode == -signal.SIGINT, (result.returncode, result.stdout, result.stderr)
    assert "alive after the repeat" in result.stdout, "a repeat within the second should not end the process"
    assert "still alive" not in result.stdout, "the second press should end the process at once"


def test_preempted_exits_128_plus_the_signal_through_run_main():
    result = _script(
        """
        import signal
        from ddp_plugins.core import Preempted, run_main
        def main():
            raise Preempted(signal.SIGTERM, "ckpt")
        run_main(main)
        """
    )
    assert result.returncode == 143, result.stderr
    assert str(Preempted(signal.SIGINT, "x.ckpt")) == "preempted by SIGINT (exit code 130); checkpoint x.ckpt"


def _agree(rank, world_size):
    signum = int(signal.SIGUSR1) if rank == 1 else 0
    return agree_on_signal(signum), agree_on_signal(0)


def test_ranks_agree_on_a_signal_that_reached_one_of_them(dist_pool):
    assert dist_pool.run(_agree) == [(int(signal.SIGUSR1), 0)] * 2


def _one_step_behind(rank, world_size):
    import torch.distributed as dist

    side = dist.new_group(backend="gloo")  # where rank 1 waits for rank 0 before its first poll
    agreement, seen = SignalAgreement(), []
    if rank == 1:
        dist.barrier(group=side)  # a poll that waited for the other rank would never get here
    seen.append(agreement.poll(0))
    if rank == 0:
        dist.barrier(group=side)
    seen.append(agreement.poll(int(signal.SIGUSR1) if rank == 1 else 0))  # rank 1 is signalled
    seen.append(agreement.poll(0))  # ... and every rank learns it one poll later
    seen.append(agreement.poll(0))  # nothing was started after an agreed stop
    agreement.poll(int(signal.SIGTERM) if rank == 0 else 0)
    seen.append(agreement.settle(int(signal.SIGUSR2) if rank == 1 else 0))  # in flight and now, waited for
    seen.append(agreement.settle(0))
    dist.destroy_process_group(side)
    return seen


def test_the_agreement_never_waits_for_the_other_ranks_and_is_one_poll_behind(dist_pool):
    expected = [0, 0, int(signal.SIGUSR1), 0, max(int(signal.SIGTERM), int(signal.SIGUSR2)), 0]
    assert dist_pool.run(_one_step_behind, timeout=30) == [expected] * 2


def _auto_schedule(rank, world_size):
    """200 boundaries, each rank on its own fake clock: rank 1 takes 40 ms a boundary, rank 0
    10 ms, until boundary 100, where rank 0 becomes the slow one (100 ms); rank 1 is signalled at
    boundary 150; an epoch's end (``settle``) at boundary 120."""
    now = [0.0]
    agreement, started, stopped = SignalAgreement(every="auto", clock=lambda: now[0]), [], None
    for boundary in range(1, 201):
        now[0] += (0.04 if rank == 1 else 0.01) if boundary <= 100 else (0.1 if rank == 0 else 0.01)
        if boundary == 120:
            agreement.settle(0)
            continue
        agreed = agreement.at_boundary(int(signal.SIGUSR1) if rank == 1 and boundary >= 150 else 0)
        if agreed:
            stopped = (boundary, agreed)
            break
        if agreement._pending is not None:  # an exchange started at this boundary
            started.append(boundary)
    return started, stopped


def test_the_auto_schedule_exchanges_at_the_same_boundaries_on_every_rank(dist_pool):
    """Every rank derives the next exchange from the slowest rank's agreed pace: 0.5 s / 40 ms = 12
    boundaries apart, then 0.5 s / 100 ms = 5 once rank 0 is the slow one; it calibrates again
    after an epoch's end, and a flag stops both ranks one boundary after the exchange that carried it."""
    (started, stopped), other = dist_pool.run(_auto_schedule, timeout=30)
    assert other == (started, stopped), "the ranks exchanged at different boundaries"
    assert started[:2] == [1, 2], started  # unmeasured, then measured over one boundary
    gaps = [b - a for a, b in zip(started, started[1:], strict=False)]
    first = [g for a, g in zip(started, gaps, strict=False) if 2 <= a and a + g <= 100]
    assert first and set(first) == {12}, started
    late = [g for a, g in zip(started, gaps, strict=False) if a >= 123]
    assert late and set(late) == {5}, started
    assert [b for b in started if 120 < b <= 123] == [121, 122], "measured afresh after the epoch's end"
    assert (
        stopped is not None and stopped[1] == signal.SIGUSR1 and stopped[0] == min(b for b in started if b >= 150) + 1
    ), (started, stopped)


def test_the_schedule_is_checked():
    assert SignalAgreement(every="auto").every == "auto"
    for bad in (0, "often", 1.5, True):
        with pytest.raises((TypeError, ValueError), match="`every` should be 'auto' or an integer >= 1"):
            SignalAgreement(every=bad)


def _gather(rank, world_size):
    checkpoint = {"callbacks": {"B": {"per_rank": f"b{rank}"}, "A": {"per_rank": {"r": rank}, "x": 1}, "C": {"y": 2}}}
    return gather_per_rank(checkpoint)


def test_per_rank_parts_are_gathered_in_rank_order(dist_pool):
    for result in dist_pool.run(_gather):
        assert result == {"callbacks": {
            "B": {"per_rank": ["b0", "b1"]}, "A": {"per_rank": [{"r": 0}, {"r": 1}], "x": 1}, "C": {"y": 2},
        }}  # fmt: skip


def test_slurm_and_torchrun_run_names():
    assert slurm_job_id({"SLURM_JOB_ID": "5"}) == "5"
    assert slurm_job_id({"SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "2", "SLURM_JOB_ID": "9"}) == "5_2"
    assert stable_run_name({"SLURM_JOB_ID": "5", "TORCHELASTIC_RUN_ID": "x"}) == "slurm-5"
    assert stable_run_name({"TORCHELASTIC_RUN_ID": "a/b c"}) == "torchrun-a_b_c"
    assert stable_run_name({"TORCHELASTIC_RUN_ID": "none"}) == f"torchrun-agent{os.getppid()}"
    assert stable_run_name({}) is None


def test_a_torchrun_restart_round_gets_keys_of_its_own_in_the_agent_store():
    """torchrun hands every round the agent's store unprefixed: a restarted group could read the
    dead round's gloo addresses. The scoped store puts each round's keys under its restart count."""
    import datetime

    import torch.distributed as dist

    from ddp_plugins.testing import free_port

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=10))
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2"}  # fmt: skip
    rounds = [restart_scoped_store(datetime.timedelta(seconds=10), {**env, "TORCHELASTIC_RESTART_COUNT": str(n)})
              for n in (0, 1)]  # fmt: skip
    rounds[0].set("rank_1", "address of the dead round")
    assert not rounds[1].check(["rank_1"]), "round 1 must not see round 0's keys"
    assert agent.get("ddp_plugins/restart_0/rank_1") == b"address of the dead round"
    assert restart_scoped_store(datetime.timedelta(seconds=1), {"MASTER_PORT": str(port)}) is None


def test_submitit_signal_is_usr2_or_what_submitit_was_told():
    assert submitit_signal({"SUBMITIT_EXECUTOR": "slurm"}) == signal.SIGUSR2
    assert submitit_signal({"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "USR1"}) == signal.SIGUSR1
    assert submitit_signal({"SUBMITIT_PREEMPT_SIGNAL": "USR1"}) is None, "only inside a submitit job"
    with pytest.raises(ValueError, match="`signals` should be signal names"):
        submitit_signal({"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "KILL"})


def test_latest_checkpoint_is_the_last_written_and_ignores_temporary_files(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    for name in ("last.ckpt", "step-9.ckpt"):
        (tmp_path / name).write_bytes(b"x")
        time.sleep(0.01)
    (tmp_path / ".step-12.ckpt.123.tmp").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("x")
    assert latest_checkpoint(tmp_path).name == "step-9.ckpt"


def test_the_write_order_outlives_a_copy_that_drops_modification_times_and_sha256sum_checks_the_sidecar(tmp_path):
    run = tmp_path / "run"
    for name in ("step-2.ckpt", "last.ckpt", "step-4.ckpt", "last.ckpt", "step-4-preempted.ckpt"):
        save_checkpoint_file({"name": name}, run / name)
    remove_checkpoint_file(run / "step-2.ckpt")  # pruned: the next write still comes after every one left
    save_checkpoint_file({"name": "step-6.ckpt"}, run / "step-6.ckpt")
    written = ["step-6.ckpt", "step-4-preempted.ckpt", "last.ckpt", "step-4.ckpt"]
    assert [write_number(run / name) for name in written] == [6, 5, 4, 3]
    # a copy that does not keep modification times: the order comes from the sidecars
    copy = tmp_path / "copy"
    copy.mkdir()
    now = time.time_ns()
    for i, name in enumerate(written):  # the newest write gets the oldest time, as if it was copied first
        for path in (run / name, digest_path(run / name)):  # the sidecar in its hidden folder
            target = copy / path.relative_to(run)
            target.parent.mkdir(exist_ok=True)
            shutil.copyfile(path, target)
            os.utime(target, ns=(now + i * 10**9, now + i * 10**9))
    assert latest_checkpoint(copy).name == "step-6.ckpt"
    assert newest_valid_checkpoint(copy) == (copy / "step-6.ckpt", [])
    # a file another tool wrote (no sidecar) is older than every numbered one, whatever its time; written
    # after the newest valid one, it is named as skipped
    (copy / "foreign.ckpt").write_bytes(b"x")
    os.utime(copy / "foreign.ckpt", ns=(now + 10**9 // 2, now + 10**9 // 2))
    assert latest_checkpoint(copy).name == "step-6.ckpt"
    found, skipped = newest_valid_checkpoint(copy)
    assert found == copy / "step-6.ckpt" and [(p.name, why.split(" (")[0]) for p, why in skipped] == [
        ("foreign.ckpt", "no digest")
    ]
    sha256sum = shutil.which("sha256sum")
    if sha256sum is not None:  # the sidecar stays `sha256sum -c`'s format (the write number is a comment)
        sidecar = digest_path(copy / "last.ckpt").relative_to(copy)  # checked from the checkpoints' folder
        checked = subprocess.run([sha256sum, "--strict", "-c", sidecar], cwd=copy, capture_output=True)
        assert checked.returncode == 0 and checked.stdout == b"last.ckpt: OK\n", checked


def test_a_failed_save_leaves_neither_a_file_nor_a_partial_one(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    target = tmp_path / "a.ckpt"
    save_atomic({"ok": 1}, target)
    with pytest.raises(RuntimeError, match="disk full"):
        save_atomic({"bad": Unpicklable()}, target)
    assert torch.load(target) == {"ok": 1}, "the previous checkpoint is untouched"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]


def test_metrics_rows_are_counted_and_cut_back(tmp_path):
    path = tmp_path / "metrics.csv"
    assert count_csv_rows(path) == 0 and truncate_csv_rows(path, 3) == 0
    path.write_text("epoch,loss,step\n0,1.5,0\n0,1.2,1\n1,,2\n")
    assert count_csv_rows(path) == 3
    assert truncate_csv_rows(path, 5) == 0
    assert truncate_csv_rows(path, 1) == 2
    assert path.read_text().splitlines() == ["epoch,loss,step", "0,1.5,0"]


def test_resumable_sampler_skips_once_sets_the_epoch_first_and_draws_nothing_global():
    data = list(range(40))
    reference = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=7)
    reference.set_epoch(3)
    order = list(reference)

    inner = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=7)
    sampler = ResumableSampler(inner, skip=8, epoch=3, seed=7, rank=1)
    assert inner.epoch == 3, "the resumed epoch is set before any iterator exists"
    assert len(sampler) == len(order) and sampler.shuffle is True
    loader = DataLoader(data, batch_size=4, sampler=sampler, generator=sampler.generator)
    state = torch.get_rng_state()
    batches = [b.tolist() for b in loader]
    assert torch.equal(torch.get_rng_state(), state), "making and running the iterator drew from the global stream"
    assert sum(batches, []) == order[8:], "the first iteration continues after the skipped batches"
    assert sum(([b.tolist() for b in loader]), []) == order, "later iterations are whole"

    seeds = []
    for epoch in (3, 4, 3):
        sampler.set_epoch(epoch)
        seeds.append(sampler.generator.initial_seed())
    assert seeds[0] == seeds[2] != seeds[1], "the loader generator is reseeded per epoch, reproducibly"
    other_rank = ResumableSampler(DistributedSampler(data, num_replicas=2, rank=0, seed=7), epoch=3, seed=7, rank=0)
    assert other_rank.generator.initial_seed() != seeds[0]


def test_preempted_is_a_system_exit_with_the_checkpoint():
    err = Preempted(signal.SIGUSR1, "c.ckpt")
    assert isinstance(err, SystemExit) and err.code == 128 + signal.SIGUSR1 and err.checkpoint == "c.ckpt"
