"""The shared toolkit: free ports, the loopback environment, and spawn() on real gloo ranks."""

import socket
import time

import pytest
import torch
import torch.distributed as dist

from ddp_plugins.core.toolkit import LOOPBACK_ENV, free_port, loopback_env, spawn


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
