"""The core on CUDA tensors: 2 ranks sharing one GPU over gloo, each compared with one process on the union.

Marked `gpu`: `make gpu-check` runs them on a machine with a CUDA GPU (CUDA hidden from the CPU suite,
they are skipped there with the reason). The ranks are plain torch (:func:`ddp_plugins.testing.spawn`,
gloo on 127.0.0.1) with their tensors on ``cuda:0``; gloo takes CUDA tensors, so two ranks can share
a GPU, which nccl refuses. Results come back to the test process on the CPU.

The same file proves on a 1-rank nccl group what the device rule decides (:func:`collective_device`,
results back on the caller's device). What the CPU suite proves of it, with CUDA's presence mocked
where the code only branches on it, is in ``tests/core/test_devices.py``.
"""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_plugins.core import (
    ArgumentValueError,
    CountingCommHook,
    build_comm_hook,
    check_comm_hook,
    collective_device,
    convert_sync_batchnorm,
    distributed_concat,
    rank_seed,
    seed_everything_rank_aware,
)
from ddp_plugins.testing import spawn
from tests.core.test_comm_hooks import _net as _hooks_net
from tests.core.test_sync_batchnorm_dtypes import TOLERANCES, _global_batch, _layer

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def _on_cpu(tensors):
    """CPU copies, as bytes: a tensor sent through spawn's queue would be shared by a file descriptor
    that dies with the rank."""
    buffer = io.BytesIO()
    torch.save([t.detach().cpu() for t in tensors], buffer)
    return buffer.getvalue()


def _loaded(data):
    return torch.load(io.BytesIO(data), weights_only=True)


# ---------------------------------------------------------------- SyncBN, forward and backward


def _sync_bn_rank(rank, world_size, dtype):
    x, dy = (t.to(CUDA) for t in _global_batch(dtype))
    rows = slice(rank * 4, rank * 4 + 4)
    layer = convert_sync_batchnorm(_layer(dtype)).to(CUDA)
    xr = x[rows].clone().requires_grad_(True)
    out = layer(xr)
    out.backward(dy[rows])
    assert out.device == CUDA and xr.grad.device == CUDA, "results stay on the rank's GPU"
    return _on_cpu([out, xr.grad, layer.weight.grad, layer.bias.grad, layer.running_mean, layer.running_var])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sync_batchnorm_on_a_shared_gpu_equals_one_process_on_the_union(dtype):
    results = [_loaded(r) for r in spawn(_sync_bn_rank, dtype, world_size=2, timeout=120)]
    x, dy = (t.to(CUDA) for t in _global_batch(dtype))
    reference = _layer(dtype).to(CUDA)
    xg = x.clone().requires_grad_(True)
    out = reference(xg)
    out.backward(dy)
    out, dx = out.detach().cpu(), xg.grad.cpu()
    rtol, atol = TOLERANCES[dtype]
    for rank, (out_r, dx_r, _dw, _db, mean_r, var_r) in enumerate(results):
        rows = slice(rank * 4, rank * 4 + 4)
        torch.testing.assert_close(out_r, out[rows], rtol=rtol, atol=atol)
        torch.testing.assert_close(dx_r, dx[rows], rtol=rtol, atol=atol)
        torch.testing.assert_close(mean_r, reference.running_mean.cpu(), rtol=rtol, atol=atol)
        torch.testing.assert_close(var_r, reference.running_var.cpu(), rtol=rtol, atol=atol)
    weight_grad, bias_grad = reference.weight.grad.cpu(), reference.bias.grad.cpu()
    torch.testing.assert_close(results[0][2] + results[1][2], weight_grad, rtol=rtol * 4, atol=atol * 4)
    torch.testing.assert_close(results[0][3] + results[1][3], bias_grad, rtol=rtol * 4, atol=atol * 4)


# ---------------------------------------------------------------- distributed_concat


def _rows(n):
    return torch.arange(n * 3, dtype=torch.float32).view(n, 3)


def _concat_rank(rank, world_size):
    mine = _rows(7)[[0, 1, 2, 3] if rank == 0 else [4, 5, 6]].to(CUDA)  # uneven shards
    out = distributed_concat({"x": mine, "i": torch.arange(len(mine), device=CUDA)}, 7)
    assert out["x"].device == CUDA, "the gathered rows come back on the caller's device"
    return _on_cpu([out["x"]])


def test_distributed_concat_of_cuda_tensors_gives_the_rows_in_order():
    for result in spawn(_concat_rank, world_size=2, timeout=120):
        assert torch.equal(_loaded(result)[0], _rows(7))


# ---------------------------------------------------------------- DDP, accumulation without all-reduce


STEPS, MICRO, ROWS = 3, 2, 4  # per rank: 3 optimizer steps of 2 micro-batches of 4 rows


def _net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _data(world_size):
    gen = torch.Generator().manual_seed(2)
    return torch.randn(STEPS, MICRO, world_size * ROWS, 16, generator=gen), torch.randn(
        STEPS, MICRO, world_size * ROWS, 4, generator=gen
    )


def _accumulate_rank(rank, world_size):
    """AccumulationNoSync's rule on raw DDP: no_sync for the first micro-batches, one all-reduce per step."""
    x, y = (t.to(CUDA) for t in _data(world_size))
    model = DistributedDataParallel(_net().to(CUDA))
    counter = CountingCommHook()
    model.register_comm_hook(None, counter)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    for step in range(STEPS):
        for micro in range(MICRO):
            # DDP decides at forward time whether the backward all-reduces: both go under no_sync
            with model.no_sync() if micro < MICRO - 1 else contextlib.nullcontext():
                (nn.functional.mse_loss(model(x[step, micro, rows]), y[step, micro, rows]) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return _on_cpu(model.module.parameters()), counter.rounds


def test_ddp_accumulation_on_a_shared_gpu_all_reduces_once_per_step_and_equals_one_process():
    results = spawn(_accumulate_rank, world_size=2, timeout=120)
    x, y = (t.to(CUDA) for t in _data(2))
    net = _net().to(CUDA)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        for micro in range(MICRO):
            (nn.functional.mse_loss(net(x[step, micro]), y[step, micro]) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    for rank, (data, rounds) in enumerate(results):
        params = _loaded(data)
        assert rounds == STEPS, f"rank {rank}: {rounds} gradient all-reduce rounds for {STEPS} optimizer steps"
        for got, ref in zip(params, net.parameters(), strict=True):
            torch.testing.assert_close(got, ref.detach().cpu(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- per-rank CUDA random streams


def _cuda_draws_rank(rank, world_size):
    seed_everything_rank_aware(7)
    return torch.rand(4, device=CUDA).tolist()


def test_each_rank_draws_its_own_cuda_stream_the_one_of_its_rank_seed():
    draws = [torch.tensor(d) for d in spawn(_cuda_draws_rank, world_size=2, timeout=120)]
    assert not torch.equal(draws[0], draws[1]), "ranks must draw distinct CUDA random streams"
    for rank, got in enumerate(draws):
        torch.cuda.manual_seed_all(rank_seed(7, rank))
        assert torch.equal(got, torch.rand(4, device=CUDA).cpu()), f"rank {rank}: not the stream of its seed"


# ---------------------------------------------------------------- comm hooks on CPU tensors, CUDA present


def _powersgd_on_cpu_tensors(rank, world_size):
    model = DistributedDataParallel(_hooks_net())  # a CPU model; this machine has CUDA
    model.register_comm_hook(*build_comm_hook("powersgd"))
    with pytest.raises(ArgumentValueError) as err:  # at the hook's first call
        model(torch.randn(2, 32)).sum().backward()
    return str(err.value)


def test_powersgd_on_cpu_tensors_is_refused_in_one_line_on_a_machine_with_cuda():
    """torch's PowerSGD hook synchronizes the bucket's device as a CUDA device wherever CUDA is: on a CPU
    model it cannot run, so the pack refuses it in one line, before launch and at the hook's first call
    (the CPU suite proves the same with CUDA mocked: tests/core/test_comm_hooks.py)."""
    expected = "`comm_hook` should be 'none' or 'fp16' for a CPU model on a machine with CUDA, got 'powersgd'."
    with pytest.raises(ArgumentValueError) as err:
        check_comm_hook("powersgd", "gloo", torch.device("cpu"))
    for message in (str(err.value), *spawn(_powersgd_on_cpu_tensors, world_size=2, timeout=120)):
        assert message.startswith(expected) and "\n" not in message, message


# ---------------------------------------------------------------- the device rule on nccl


def test_on_nccl_collectives_run_on_the_gpu_and_results_come_back_where_they_were(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        assert collective_device() == CUDA
        rows = _rows(5)
        gathered = distributed_concat(rows, 5)  # CPU rows over nccl: gathered on the GPU, returned on the CPU
        assert gathered.device.type == "cpu" and torch.equal(gathered, rows)
    finally:
        dist.destroy_process_group()
