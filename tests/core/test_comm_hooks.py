"""DDP communication hooks by name and the counting hook, on raw DDP (2 gloo ranks).

Plain torch: no Lightning. The Trainer-level use is tested in tests/lightning/.
"""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from torch.nn.parallel import DistributedDataParallel

from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.core.comm_hooks import CountingCommHook, build_comm_hook, check_comm_hook
from tests.helpers.collectives import count_collectives

# ---------------------------------------------------------------- communication hooks on 2 gloo ranks

STEPS = 4
PER_RANK = 8
WORLD = 2


def _data(world_size):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, world_size * PER_RANK, 32, generator=g)
    y = torch.randn(STEPS, world_size * PER_RANK, 8, generator=g)
    return x, y


def _net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))


def _train(model, x, y, lo, hi):
    """SGD steps on rows [lo, hi) of each step's global batch; grads and losses of every step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, losses = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[step, lo:hi]), y[step, lo:hi])
        loss.backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        losses.append(loss.item())
        opt.step()
    return grads, losses


def _test_hook_trains(rank, world_size, name):
    x, y = _data(world_size)
    model = DistributedDataParallel(_net())
    state, hook = build_comm_hook(name, powersgd_rank=1, powersgd_start_iter=2)
    if hook is not None:
        model.register_comm_hook(state, hook)
    return _train(model, x, y, rank * PER_RANK, (rank + 1) * PER_RANK)


@pytest.mark.parametrize("name", ["none", "fp16"])
def test_allreduce_and_fp16_hooks_equal_single_process_gradients(dist_pool, name):
    results = dist_pool.run(_test_hook_trains, name)
    x, y = _data(2)
    ref_grads, _ = _train(_net(), x, y, 0, 2 * PER_RANK)  # one process, the global batch
    tol = {"none": {"rtol": 1e-5, "atol": 1e-6}, "fp16": {"rtol": 2e-3, "atol": 2e-4}}[name]
    for rank, (grads, _) in enumerate(results):
        for step, (got, ref) in enumerate(zip(grads, ref_grads, strict=True)):
            for g, r in zip(got, ref, strict=True):
                where = f"{name}, rank {rank}, step {step}"
                torch.testing.assert_close(g, r, **tol, msg=lambda m, where=where: f"{where}: {m}")
    if name == "fp16":  # the compression is real: not bit-identical to the exact all-reduce
        assert any(not torch.equal(g, r) for g, r in zip(results[0][0][-1], ref_grads[-1], strict=True))


def test_powersgd_is_exact_before_its_start_iteration_then_a_rank_one_projection(dist_pool):
    results = dist_pool.run(_test_hook_trains, "powersgd")
    x, y = _data(2)
    ref_grads, _ = _train(_net(), x, y, 0, 2 * PER_RANK)
    (grads0, losses0), (grads1, _) = results
    for step in range(STEPS):
        for g0, g1 in zip(grads0[step], grads1[step], strict=True):
            torch.testing.assert_close(g0, g1, rtol=0, atol=0, msg="replicas got different gradients")
    for step in (0, 1):  # plain all-reduce before start_powerSGD_iter=2
        for g, r in zip(grads0[step], ref_grads[step], strict=True):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    # step 2: same parameters as the reference; the 32x32 weight is compressed to P P^T M, a rank-1
    # orthogonal projection of the single-process gradient M; 1-D biases go uncompressed
    weight, ref_weight = grads0[2][0], ref_grads[2][0]
    assert torch.linalg.matrix_rank(weight, rtol=1e-4).item() == 1, "PowerSGD rank-1 gradient expected"
    torch.testing.assert_close((weight * ref_weight).sum(), (weight * weight).sum(), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(grads0[2][1], ref_grads[2][1], rtol=1e-5, atol=1e-6)
    # later steps (with error feedback) stay rank-1 and finite
    assert all(torch.linalg.matrix_rank(grads0[step][0], rtol=1e-4).item() == 1 for step in range(2, STEPS))
    assert all(torch.isfinite(torch.tensor(losses0)))


# ---------------------------------------------------------------- CountingCommHook on raw DDP (fast pool)


def _user_hook(state, bucket):
    """A user's own hook: records that it ran, then does the default all-reduce."""
    _user_hook.seen += 1
    return allreduce_hook(state, bucket)


_user_hook.seen = 0


def _test_counting_hook(rank, world_size, which):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    numel = sum(p.numel() for p in net.parameters())
    ddp = DistributedDataParallel(net)
    _user_hook.seen = 0
    if which == "fp16_wrapper":  # a wrapper around the counter, as Lightning's `ddp_comm_wrapper` composes hooks
        counter = CountingCommHook()
        ddp.register_comm_hook(None, fp16_compress_wrapper(counter))
    else:
        hooks = {"default": (None, None), "user": (None, _user_hook), "fp16": (None, fp16_compress_hook)}
        state, hook = hooks.get(which) or build_comm_hook("powersgd", powersgd_rank=1, powersgd_start_iter=2)
        counter = CountingCommHook(hook)
        ddp.register_comm_hook(state, counter)
    torch.manual_seed(10 + rank)
    x = torch.randn(4, 8)
    with ddp.no_sync():
        ddp(x).sum().backward()  # accumulated locally, nothing sent
    after_no_sync = counter.calls
    with count_collectives(("all_reduce",)) as sent:  # every thread: PowerSGD's callbacks too
        for _ in range(4):
            ddp(x).sum().backward()
    counted = (counter.calls, counter.bytes, sent.calls["all_reduce"], sent.bytes["all_reduce"])
    return after_no_sync, counted, counter.rounds, _user_hook.seen, numel, [p.grad.clone() for p in net.parameters()]


def test_counting_hook_counts_calls_and_bytes_and_keeps_the_default_math(dist_pool):
    results = dist_pool.run(_test_counting_hook, "default")
    # one process: both ranks' inputs, summed losses / world size, five backward passes (1 no_sync + 4)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    for rank in range(WORLD):
        torch.manual_seed(10 + rank)
        x = torch.randn(4, 8)
        (net(x).sum() * 5 / WORLD).backward()
    for after_no_sync, counted, rounds, _, numel, grads in results:
        assert after_no_sync == 0, "no_sync step sent something"
        assert counted == (4, 4 * numel * 4) * 2 and rounds == 4, "one fp32 bucket per synchronized backward"
        for g, e in zip(grads, [p.grad for p in net.parameters()], strict=True):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("which", ["user", "fp16", "fp16_wrapper", "powersgd"])
def test_counting_hook_counts_what_torch_distributed_sends(dist_pool, which):
    results = dist_pool.run(_test_counting_hook, which)
    for after_no_sync, (calls, nbytes, sent_calls, sent_bytes), rounds, user_seen, numel, _ in results:
        assert (after_no_sync, rounds) == (0, 4)
        assert (calls, nbytes) == (sent_calls, sent_bytes), "the counter disagrees with torch.distributed.all_reduce"
        if which == "user":
            assert user_seen == 4, "the user's hook did not run on every synchronized backward"
        if which.startswith("fp16"):
            assert nbytes == 4 * numel * 2, "fp16 compression should halve the bytes on the wire"
        if which == "powersgd":  # 2 plain rounds, then 2 of 3 all-reduces (uncompressed, P, Q) and fewer bytes
            assert calls == 2 + 2 * 3 and nbytes < 4 * numel * 4
    torch.testing.assert_close(results[0][-1], results[1][-1], msg="ranks disagree after sync")


def _test_powersgd_refused_on_a_cpu_model_with_cuda(rank, world_size):
    model = DistributedDataParallel(_net())
    model.register_comm_hook(*build_comm_hook("powersgd"))
    with mock.patch.object(torch.cuda, "is_available", return_value=True):  # a machine with a GPU, as torch sees it
        with pytest.raises(ArgumentValueError) as err:
            model(torch.randn(2, 32)).sum().backward()
    return str(err.value)


def test_powersgd_on_a_cpu_model_of_a_machine_with_cuda_is_refused(dist_pool):
    expected = "`comm_hook` should be 'none' or 'fp16' for a CPU model on a machine with CUDA, got 'powersgd'."
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        with pytest.raises(ArgumentValueError) as err:
            check_comm_hook("powersgd", "gloo", torch.device("cpu"))  # before any process starts
    for message in (str(err.value), *dist_pool.run(_test_powersgd_refused_on_a_cpu_model_with_cuda)):
        assert message.startswith(expected) and "CUDA_VISIBLE_DEVICES=" in message and "\n" not in message
    check_comm_hook("powersgd", "gloo", "cpu")  # a machine without CUDA runs it (the tests above)


# ---------------------------------------------------------------- arguments (no processes)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: build_comm_hook("fp8"),
            ValueError,
            "`comm_hook` should be one of 'none', 'fp16', 'bf16', 'powersgd', got 'fp8'.",
        ),
        (
            lambda: check_comm_hook("bf16", "gloo"),
            ValueError,
            "or 'bf16' with the nccl backend and NCCL 2.10+, got 'bf16' with the gloo backend.",
        ),
        (
            lambda: build_comm_hook("powersgd", powersgd_rank=0),
            ValueError,
            "`powersgd_rank` should be an integer >= 1, got 0.",
        ),
        (
            lambda: build_comm_hook("powersgd", powersgd_start_iter=1),
            ValueError,
            "`powersgd_start_iter` should be an integer >= 2, got 1.",
        ),
        (
            lambda: CountingCommHook(hook=3),
            TypeError,
            "`hook` should be a DDP communication hook (callable) or None, got 3.",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors_naming_the_argument(call, error, message):
    with pytest.raises(error) as err:
        call()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_hooks_by_name_are_torchs_own():
    assert build_comm_hook("none") == (None, None)
    assert build_comm_hook("fp16")[1] is fp16_compress_hook
    check_comm_hook("bf16")  # the name alone is valid; only a backend without it is refused


# ---------------------------------------------------------------- the tests' count_collectives (tests/helpers)


def _test_count_collectives(rank, world_size):
    original = dist.all_reduce
    with count_collectives() as outer:
        dist.all_reduce(torch.ones(3))  # 12 bytes
        with count_collectives(("all_reduce",)) as inner:
            dist.all_reduce(torch.ones(2, dtype=torch.float64))  # 16 bytes
        dist.broadcast(torch.ones(5, dtype=torch.int8), src=0)  # 5 bytes
        gathered = [torch.zeros(2) for _ in range(world_size)]
        dist.all_gather(gathered, torch.ones(2))  # 8 bytes sent
    dist.all_reduce(torch.ones(1))  # after the counter: not counted
    return dict(outer.calls), dict(outer.bytes), dict(inner.calls), dict(inner.bytes), dist.all_reduce is original


def test_count_collectives_counts_calls_and_bytes_nests_and_restores(dist_pool):
    for outer_calls, outer_bytes, inner_calls, inner_bytes, restored in dist_pool.run(_test_count_collectives):
        assert outer_calls == {"all_reduce": 2, "broadcast": 1, "all_gather": 1}
        assert outer_bytes == {"all_reduce": 12 + 16, "broadcast": 5, "all_gather": 8}
        assert (inner_calls, inner_bytes) == ({"all_reduce": 1}, {"all_reduce": 16})
        assert restored, "torch.distributed.all_reduce was not restored"
