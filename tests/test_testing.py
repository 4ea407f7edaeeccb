"""The harness itself (``ddp_plugins.testing``): real gloo groups, results by rank, a hang fails fast."""

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from ddp_plugins.testing import LOOPBACK_ENV, DistributedPool, free_port, loopback_env, run_lightning, spawn


def test_free_port_can_be_bound_on_loopback():
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_loopback_env_pins_gloo_and_drops_the_launcher_variables():
    base = {"PATH": "/bin", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_PORT": "1", "NODE_RANK": "2"}
    env = loopback_env(base, MASTER_PORT="2345", EXTRA="x")
    assert env == {"PATH": "/bin", **LOOPBACK_ENV, "MASTER_PORT": "2345", "EXTRA": "x"}
    assert base["RANK"] == "3", "the given mapping must not change"


def _all_reduce_rank(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return rank, world_size, t.item()


def test_spawn_runs_every_rank_in_one_gloo_group_and_returns_by_rank():
    assert spawn(_all_reduce_rank, 10, world_size=2, timeout=120) == [(0, 2, 21.0), (1, 2, 21.0)]


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise KeyError("boom on rank 1")
    return rank


def test_a_raising_rank_is_reported_with_its_exception():
    with pytest.raises(RuntimeError, match=r"rank 1 raised KeyError: 'boom on rank 1'") as err:
        spawn(_raise_on_rank_one, world_size=2, timeout=120)
    assert isinstance(err.value.__cause__, KeyError)


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(60)
    return rank


def test_a_hang_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish on 2 ranks within 5"):
        spawn(_hang_on_rank_zero, world_size=2, timeout=5, pg_timeout=60)
    assert time.monotonic() - start < 40, "the ranks were not killed at the timeout"


def _test_all_reduce_equals_sum(rank, world_size):
    t = torch.arange(4, dtype=torch.float32) + rank
    dist.all_reduce(t)
    return t


def test_pool_runs_every_rank_and_matches_single_process_sum(dist_pool):
    results = dist_pool.run(_test_all_reduce_equals_sum)
    expected = sum(torch.arange(4, dtype=torch.float32) + r for r in range(2))
    assert len(results) == 2
    for t in results:
        torch.testing.assert_close(t, expected)


@pytest.mark.e2e
def test_a_pool_hang_fails_fast_and_the_pool_recovers():
    pool = DistributedPool(world_size=2, timeout=4, pg_timeout=20)
    try:
        pool.run(_test_all_reduce_equals_sum)  # the ranks' start-up is not part of a call's timeout
        start = time.monotonic()
        with pytest.raises(AssertionError, match="hang"):
            pool.run(_hang_on_rank_zero)
        assert time.monotonic() - start < 30, "the harness timeout did not stop a hang"
        assert pool.run(_test_all_reduce_equals_sum)[1][0] == 1.0, "a fresh group after the hang"
    finally:
        pool.close()


def _lightning_rank(out_dir, offset):
    """What a run_lightning rank sees: the launcher's variables, its own process group, Lightning's ranks."""
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE_HINT"]), strategy="ddp", logger=False)
    trainer.strategy.setup_environment()  # the group, from the launcher's variables
    t = torch.tensor([float(trainer.global_rank + offset)])
    dist.all_reduce(t)
    print(f"rank {trainer.global_rank} says hello")
    launched = trainer.strategy.cluster_environment.creates_processes_externally
    return trainer.global_rank, trainer.world_size, t.item(), os.getpid(), os.getpgid(0), launched


def test_run_lightning_runs_a_trainer_on_forked_ranks_and_returns_by_rank():
    first = run_lightning(_lightning_rank, 10, world_size=2, timeout=120)
    assert [r[:3] for r in first] == [(0, 2, 21.0), (1, 2, 21.0)]
    assert all(r[5] for r in first), "Lightning must take the ranks as launched (it starts no process)"
    assert [r[3] for r in first] == [r[4] for r in first], "each rank leads its own process group"
    assert len({first[0][3], first[1][3], os.getpid()}) == 3
    (alone,) = run_lightning(_lightning_rank, 1, world_size=1, timeout=120)
    assert alone[:3] == (0, 1, 1.0) and alone[3] not in (first[0][3], first[1][3]), "fresh ranks each call"


def _fail_or_wait(out_dir, failing_rank, how):
    time.sleep(0.2)
    rank = int(os.environ["RANK"])
    if rank == failing_rank:
        print(f"rank {rank} is about to fail", flush=True)
        if how == "raise":
            raise KeyError(f"boom on rank {rank}")
        os.kill(os.getpid(), 9)
    time.sleep(600)  # a rank left waiting (in a collective, say) is stopped, not waited for


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_is_reported_with_its_output_and_the_others_are_stopped(how):
    start = time.monotonic()
    with pytest.raises(AssertionError) as caught:
        run_lightning(_fail_or_wait, 1, how, world_size=2, timeout=120)
    message = str(caught.value)
    assert "ranks exited with {" in message and ("1: 1" if how == "raise" else "1: -9") in message, message
    assert "rank 1 is about to fail" in message, message
    if how == "raise":
        assert "KeyError: 'boom on rank 1'" in message, message
    assert time.monotonic() - start < 30, "the waiting rank was not stopped soon after the failure"


def test_a_run_lightning_hang_fails_at_the_timeout_and_the_next_call_runs():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"did not finish on 2 ranks within 5s \(hang\)"):
        run_lightning(_fail_or_wait, -1, "raise", world_size=2, timeout=5)
    assert time.monotonic() - start < 40, "the ranks were not killed at the timeout"
    assert [r[2] for r in run_lightning(_lightning_rank, 0, timeout=120)] == [1.0, 1.0]
