"""The strategy's backend on GPUs: nccl only where every rank of a machine has a GPU of its own.

CUDA's presence is mocked (this machine has none): the decision reads only the number of GPUs, the
rank's device and the main address. On a GPU machine, tests/core/test_cuda.py runs ranks that share
a GPU over gloo for real.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment

from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.lightning import DDPPluginsStrategy


@pytest.fixture
def gpus(monkeypatch):
    """A machine with ``gpus.count`` CUDA GPUs, as the strategy sees it."""

    class Gpus:
        count = 1

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: Gpus.count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    return Gpus


def _strategy(backend: str, devices: int, num_nodes: int, main_address: str) -> DDPPluginsStrategy:
    strategy = DDPPluginsStrategy(backend=backend, cluster_environment=LightningEnvironment())
    os.environ["MASTER_ADDR"] = main_address  # LightningEnvironment's main address (restored by the fixture)
    strategy.parallel_devices = [torch.device("cuda", i) for i in range(devices)]
    strategy.num_nodes = num_nodes
    return strategy


@pytest.mark.parametrize(
    ("gpu_count", "devices", "num_nodes", "address", "expected"),
    [
        (1, 1, 1, "127.0.0.1", "nccl"),  # make train on one GPU
        (4, 4, 1, "127.0.0.1", "nccl"),  # a GPU per rank
        (2, 2, 8, "10.0.0.1", "nccl"),  # 8 machines of 2 GPUs: the other nodes are other machines
        (1, 1, 2, "127.0.0.1", "gloo"),  # two torchrun launchers on loopback, one GPU: they would share it
        (2, 2, 2, "localhost", "gloo"),
    ],
)
def test_auto_picks_nccl_only_when_every_rank_has_its_own_gpu(gpus, gpu_count, devices, num_nodes, address, expected):
    gpus.count = gpu_count
    assert _strategy("auto", devices, num_nodes, address)._get_process_group_backend() == expected


def test_nccl_on_ranks_that_share_a_gpu_is_refused_in_one_line_before_any_group(gpus):
    strategy = _strategy("nccl", 1, 2, "127.0.0.1")
    with pytest.raises(ArgumentValueError) as refused:
        strategy._configure_launcher()
    message = str(refused.value)
    assert message.startswith("`backend` should be 'gloo' or 'auto' when ranks share a GPU, got 'nccl' with 2 ranks")
    assert "\n" not in message and not dist.is_initialized()
    _strategy("nccl", 1, 1, "127.0.0.1")._configure_launcher()  # a GPU per rank: fine
