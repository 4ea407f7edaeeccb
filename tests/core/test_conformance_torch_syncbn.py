"""Conformance: torch's own SyncBatchNorm tests, ported to our CPU/gloo SyncBatchNorm on 2 ranks.

Original: ``torch/testing/_internal/distributed/distributed_test.py`` (torch 2.13), class
``DistributedTest._DistTestBase``. Every case there needs CUDA (torch's SyncBatchNorm has no CPU
kernels, and DDP refuses ``torch.nn.SyncBatchNorm`` on CPU modules); here the same models, inputs,
iteration counts and tolerances run under ``DistributedDataParallel`` on CPU with gloo, with
:func:`ddp_plugins.core.convert_sync_batchnorm` where torch calls
``nn.SyncBatchNorm.convert_sync_batchnorm`` and :class:`ddp_plugins.core.SyncBatchNorm` where torch
builds ``nn.SyncBatchNorm`` directly. Torch trains the non-DDP baseline inside every rank; here the
baseline is plain batch norm trained in this (single) process on the global batch, and each rank's
parameters after every iteration are compared with it. The tolerance is the one of torch's
``assertEqual`` (``torch.testing.assert_close``'s defaults for the dtype).

Ported (original name -> test here):

* ``test_DistributedDataParallel_SyncBatchNorm`` (``_test_DistributedDataParallel_SyncBatchNorm``,
  ``_test_DDP_niter``): ``BatchNormNet``, 2 rows per rank, 5 iterations, the DDP model saved and
  reloaded before training, at iteration 2 and at the end (done in every ``niter`` case here) ->
  ``test_ddp_syncbn_niter_matches_one_process[BatchNormNet]``.
* ``test_DistributedDataParallel_SyncBatchNorm_No_Affine`` -> ``[BatchNormNet_no_affine]``.
* ``test_DistributedDataParallel_SyncBatchNorm_2D_Input`` -> ``[2D_Input]``.
* ``test_DistributedDataParallel_SyncBatchNorm_Single_Input_Per_Process`` -> ``[Single_Input_Per_Process]``.
* ``test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_gradient`` (2 and 3 rows) ->
  ``[Diff_Input_Sizes_gradient]``.
* ``test_DistributedDataParallel_SyncBatchNorm_Channels_Last`` (``channels_last`` and
  ``channels_last_3d``, outputs must keep the memory format) -> ``[Channels_Last]``, ``[Channels_Last_3d]``.
* ``test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value`` ->
  ``test_diff_input_sizes_running_value``.
* ``test_DistributedDataParallel_SyncBatchNorm_half`` -> ``test_half`` (float16 as in torch, and
  bfloat16); torch only checks the dtypes of the output and gradients after ``out.sum().backward()``
  (kept). This also compares values with the plain model on the global batch in the same dtype, on a
  weighted sum (the softmax rows sum to 1, so ``out.sum()`` has zero gradient) and with the float16 /
  bfloat16 tolerances of test_sync_batchnorm_dtypes.py (no torch tolerance exists for this case).
* ``test_SyncBatchNorm_process_group`` -> ``test_process_group_reaches_nested_layers`` (torch uses
  torchvision's resnet50, not installed here: a small model with the same nesting,
  ``layer1[0].bn1`` and a ``downsample`` block, stands in).
* ``test_ddp_inference`` (its SyncBatchNorm half) -> ``test_inference_on_one_rank``.
* ``test_ddp_sync_bn_training_vs_eval`` (``unittest.skip``-ed upstream, pytorch PR 113620) ->
  ``test_training_vs_eval``; torch looks for ``all_gather`` in the profiler, ours communicates with
  ``all_reduce``, counted with :func:`count_collectives`.
* ``test_ddp_uneven_inputs_stop_iteration_sync_bn`` (its SyncBatchNorm model) ->
  ``test_uneven_inputs_stop_iteration``.
* ``test_sync_bn_logged`` -> ``test_ddp_accepts_converted_layers_on_cpu``: a deliberate difference.
  DDP detects SyncBatchNorm with ``isinstance(m, torch.nn.SyncBatchNorm)``; our converted layers keep
  their own class (and are not ``torch.nn.SyncBatchNorm``), so DDP logs ``has_sync_bn`` as false,
  and, unlike torch's layers, it accepts them on CPU modules. Both are asserted.

Quirks of the originals kept on purpose: ``_test_DistributedDataParallel_SyncBatchNorm`` passes
``5 if affine else 2`` positionally into ``_test_DDP_niter``'s ``zero_grad`` argument, so those cases
run the default 5 iterations with the zero-grad step; the optimizer step is ``param += grad`` (no
learning rate); only the input, not the target, is shuffled after each iteration; the DDP loss is
scaled by ``world_size * local_bs / global_bs`` only where torch passes ``world_size``.

Left out: the ``output_device`` and ``device_ids`` variants of ``test_DistributedDataParallel_SyncBatchNorm``
(CUDA device placement; a CPU DDP takes no device ids); the non-SyncBatchNorm halves of
``test_ddp_inference`` and ``test_ddp_uneven_inputs_stop_iteration_sync_bn`` (plain DDP, not our code);
``test_ddp_uneven_inputs`` and ``_test_ddp_multiple_nested_unused_params_error`` (they use
``BatchNormNet`` without SyncBatchNorm). The per-layer equivalence for every input rank, memory
format, momentum and a rank with 0 samples is in test_sync_batchnorm.py, float64/float32/bfloat16/float16
at the layer level in test_sync_batchnorm_dtypes.py; not repeated here.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_plugins.core import SyncBatchNorm, convert_sync_batchnorm
from tests.helpers.collectives import count_collectives

# ---------------------------------------------------------------- torch's models, our own code


class BatchNormNet(nn.Module):
    """torch's ``BatchNormNet``: Linear(2, 40) -> BatchNorm1d(4) on (N, 4, 10) -> Linear(40, 4) -> softmax."""

    def __init__(self, affine: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 40, bias=False)
        self.bn = nn.BatchNorm1d(4, affine=affine)
        self.fc2 = nn.Linear(40, 4, bias=False)

    def forward(self, x):
        x = torch.reshape(self.fc1(x), (-1, 4, 10))
        x = self.bn(x)
        x = torch.reshape(x, (-1, 40))
        x = self.fc2(x)
        return F.softmax(x, dim=1)


# name -> (plain model, how the DDP model is made from it, local batch sizes per rank, input shape after N,
#          target shape after N, memory format, world_size passed to _test_DDP_niter (0: loss not scaled), zero_grad)
CASES = {
    "BatchNormNet": ("bnnet", "convert", (2, 2), (2,), (4,), None, 2, True),
    "BatchNormNet_no_affine": ("bnnet_no_affine", "convert", (2, 2), (2,), (4,), None, 2, True),
    "2D_Input": ("bn1d", "convert", (2, 2), (2,), (2,), None, 0, False),
    "Single_Input_Per_Process": ("bn1d", "convert", (1, 1), (2,), (2,), None, 0, False),
    "Diff_Input_Sizes_gradient": ("bnnet", "convert", (2, 3), (2,), (4,), None, 2, True),
    "Channels_Last": ("bn2d_m099", "syncbn", (2, 2), (2, 4, 4), (2, 4, 4), torch.channels_last, 2, False),
    "Channels_Last_3d": ("bn3d_m099", "syncbn", (2, 2), (2, 4, 4, 4), (2, 4, 4, 4), torch.channels_last_3d, 2, False),
}
N_ITER = 5  # _test_DDP_niter's default; no SyncBatchNorm case passes another


def _plain_model(name: str) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights in the reference and on every rank
    return {
        "bnnet": lambda: BatchNormNet(),
        "bnnet_no_affine": lambda: BatchNormNet(affine=False),
        "bn1d": lambda: nn.BatchNorm1d(2),
        "bn2d_m099": lambda: nn.BatchNorm2d(2, momentum=0.99),
        "bn3d_m099": lambda: nn.BatchNorm3d(2, momentum=0.99),
    }[name]()


def _synced_model(name: str, how: str) -> nn.Module:
    plain = _plain_model(name)
    if how == "syncbn":  # torch builds nn.SyncBatchNorm(2, momentum=0.99) directly
        return SyncBatchNorm(plain.num_features, momentum=plain.momentum)
    return convert_sync_batchnorm(copy.deepcopy(plain))


def _case_data(case: str):
    """The global input and target and the per-iteration input permutations (torch draws them on every rank)."""
    _, _, sizes, in_shape, target_shape, memory_format, _, _ = CASES[case]
    global_bs = sum(sizes)
    gen = torch.Generator().manual_seed(1)
    inp = torch.randn(global_bs, *in_shape, generator=gen)
    target = torch.randn(global_bs, *target_shape, generator=gen)
    if memory_format is not None:
        inp, target = inp.to(memory_format=memory_format), target.to(memory_format=memory_format)
    perms = [torch.randperm(global_bs, generator=gen) for _ in range(N_ITER)]
    return inp, target, perms


def _ddp_helper(model, inp, target, scale_factor, memory_format):
    """torch's ``_test_DDP_helper``: train mode, MSE loss times the scale, backward.

    Returns whether the memory format was kept.
    """
    model.train()
    output = model(inp)
    (F.mse_loss(output, target) * scale_factor).backward()
    return memory_format is None or output.is_contiguous(memory_format=memory_format)


def _model_step(model, zero_grad):
    """torch's ``_model_step`` / ``_model_step_with_zero_grad``: ``param += grad``."""
    for param in model.parameters():
        if param.grad is not None:
            with torch.no_grad():
                param += param.grad
            if zero_grad:
                param.grad.requires_grad_(False)
                param.grad.zero_()
            else:
                param.grad = None


def _save_and_load(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------- _test_DDP_niter


def _test_ddp_niter(rank, world_size, case):
    name, how, sizes, _, _, memory_format, scale_world_size, zero_grad = CASES[case]
    inp, target, perms = _case_data(case)
    local_bs, offset, global_bs = sizes[rank], sum(sizes[:rank]), sum(sizes)
    scale = scale_world_size * local_bs / global_bs if scale_world_size else 1
    model = DistributedDataParallel(_synced_model(name, how))
    model = _save_and_load(model)  # "test serializable/unserializable"
    params, formats = [], []
    for idx in range(N_ITER):
        rows = slice(offset, offset + local_bs)
        formats.append(_ddp_helper(model, inp[rows], target[rows], scale, memory_format))
        _model_step(model, zero_grad)
        params.append(_params(model.module))
        inp = inp[perms[idx]]
        if idx == 2:  # "save the model in the middle and reload"
            model = _save_and_load(model)
    saved = _save_and_load(model)
    reloaded_equal = all(torch.equal(v, saved.state_dict()[k]) for k, v in model.state_dict().items())
    buffers = {k: v.clone() for k, v in model.module.named_buffers()}
    return params, formats, buffers, reloaded_equal, [type(m).__name__ for m in model.module.modules()]


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_syncbn_niter_matches_one_process(dist_pool, case):
    name, _, _, _, _, memory_format, _, zero_grad = CASES[case]
    results = dist_pool.run(_test_ddp_niter, case)
    # the baseline: plain batch norm, one process, the global batch, the same steps
    reference = _plain_model(name)
    inp, target, perms = _case_data(case)
    ref_params, ref_formats = [], []
    for idx in range(N_ITER):
        ref_formats.append(_ddp_helper(reference, inp, target, 1.0, memory_format))
        _model_step(reference, zero_grad)
        ref_params.append(_params(reference))
        inp = inp[perms[idx]]
    assert all(ref_formats), "the plain baseline lost the memory format"
    for rank, (params, formats, buffers, reloaded_equal, classes) in enumerate(results):
        assert any(c.startswith("Sync") for c in classes), f"no synchronized layer on rank {rank}: {classes}"
        assert all(formats), f"rank {rank}: the output lost {memory_format} in iterations {formats}"
        assert reloaded_equal, f"rank {rank}: the saved and reloaded DDP model has a different state_dict"
        for idx, (got, want) in enumerate(zip(params, ref_params, strict=True)):
            assert len(got) == len(want)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                torch.testing.assert_close(
                    g, w, msg=lambda m, i=i, idx=idx, r=rank: f"param {i}, iteration {idx}, rank {r}: {m}"
                )
        for key, want in reference.state_dict().items():
            if key in buffers:
                torch.testing.assert_close(buffers[key], want, msg=lambda m, key=key, r=rank: f"{key} on rank {r}: {m}")


# ---------------------------------------------------------------- Diff_Input_Sizes_Running_Value


def _running_value_inputs():
    """torch's inputs: rank i holds (2, 2, 10 ** (i + 1)), channel 0 = 0.1 ** (i - 1), channel 1 = 0.3 ** (i - 1)."""
    return [
        torch.cat(
            [torch.ones(2, 1, 10 ** (i + 1)) * (0.1 ** (i - 1)), torch.ones(2, 1, 10 ** (i + 1)) * (0.3 ** (i - 1))],
            dim=1,
        )
        for i in range(2)
    ]


def _test_running_value(rank, world_size):
    model = DistributedDataParallel(SyncBatchNorm(2, momentum=0.99))
    x = _running_value_inputs()[rank]
    for _ in range(100):
        model(x).mean().backward()
    return model.module.running_mean.clone(), model.module.running_var.clone(), int(model.module.num_batches_tracked)


def test_diff_input_sizes_running_value(dist_pool):
    all_input = torch.cat([x.permute(1, 0, 2).reshape(2, -1) for x in _running_value_inputs()], dim=1)
    for running_mean, running_var, tracked in dist_pool.run(_test_running_value):
        torch.testing.assert_close(running_mean, all_input.mean(1))
        torch.testing.assert_close(running_var, all_input.var(1))
        assert tracked == 100


# ---------------------------------------------------------------- _half (and bfloat16)


def _half_data(dtype):
    gen = torch.Generator().manual_seed(2)
    inp = torch.randn(4, 2, generator=gen).to(dtype)  # torch: randn(2, 2) on each of the 2 ranks
    return inp, torch.randn(4, 4, generator=gen).to(dtype)


def _half_model(dtype):
    torch.manual_seed(0)
    return BatchNormNet().to(dtype)


def _test_half(rank, world_size, dtype):
    inp, weights = _half_data(dtype)
    rows = slice(2 * rank, 2 * rank + 2)
    model = DistributedDataParallel(convert_sync_batchnorm(_half_model(dtype)))
    out = model(inp[rows])
    out.sum().backward()  # torch's check: forward and backward run, nothing leaves the dtype
    dtypes = [out.dtype] + [p.grad.dtype for p in model.parameters()]
    model.zero_grad()
    out = model(inp[rows])
    (out * weights[rows]).sum().backward()
    return dtypes, out.detach(), {name: p.grad for name, p in model.module.named_parameters()}


# torch's half test compares no values. Two float16 computations of the same gradients (a sum of
# 2 all-reduced local sums vs one sum) differ by rounding, by more than assert_close's float16 default
# (atol 1e-5): about 1e-4 here, and both are equally close to the float64 result. These are the
# tolerances of the per-layer dtype tests (test_sync_batchnorm_dtypes.py).
HALF_TOL = {torch.float16: {"rtol": 2e-3, "atol": 2e-3}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half(dist_pool, dtype):
    results = dist_pool.run(_test_half, dtype)
    # the softmax rows of BatchNormNet sum to 1, so torch's out.sum() has zero gradient (rounding noise only):
    # the values are compared on a weighted sum instead
    tol = HALF_TOL[dtype]
    inp, weights = _half_data(dtype)
    reference = _half_model(dtype)
    out = reference(inp)
    (out * weights).sum().backward()
    for rank, (dtypes, out_r, grads) in enumerate(results):
        assert dtypes == [dtype] * 5, f"rank {rank}: output and gradient dtypes {dtypes}"
        torch.testing.assert_close(out_r, out.detach()[2 * rank : 2 * rank + 2], **tol)
        for name, p in reference.named_parameters():
            # DDP averages: the mean over the ranks of the local sums is half the global sum's gradient
            torch.testing.assert_close(grads[name], p.grad / 2, **tol, msg=lambda m, name=name: f"{name}.grad: {m}")


# ---------------------------------------------------------------- test_SyncBatchNorm_process_group


class _Bottleneck(nn.Module):
    """resnet50's Bottleneck, narrow: bn1..bn3 and a downsample block with its own batch norm."""

    def __init__(self, inplanes: int, planes: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = nn.Conv2d(planes, planes * 4, 1, bias=False), nn.BatchNorm2d(planes * 4)
        self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, bias=False), nn.BatchNorm2d(planes * 4))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + self.downsample(x))


class _NestedResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.layer1 = nn.Sequential(_Bottleneck(4, 2), _Bottleneck(8, 2))
        self.layer2 = nn.Sequential(_Bottleneck(8, 4))

    def forward(self, x):
        return self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x)))))


def _nested_model():
    torch.manual_seed(0)
    return _NestedResNet()


def _test_process_group(rank, world_size):
    process_group = dist.new_group([0])  # every rank creates it; rank 1 is not a member
    model = convert_sync_batchnorm(copy.deepcopy(_nested_model()), process_group)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    nested_is_group = model.layer1[0].bn1.process_group is process_group
    all_are_group = all(getattr(m, "process_group", None) is process_group for m in bns)
    x = torch.randn(3, 3, 5, 5, generator=torch.Generator().manual_seed(rank))
    y = model(x).detach() if rank == 0 else None  # a group of one: plain batch norm, no rank-1 partner
    dist.barrier()
    return nested_is_group, all_are_group, len(bns), x, y


def test_process_group_reaches_nested_layers(dist_pool):
    results = dist_pool.run(_test_process_group)
    for nested_is_group, all_are_group, count, _, _ in results:
        assert nested_is_group, "layer1[0].bn1 did not get the process group"
        assert all_are_group and count == 13, "every nested batch norm should get the process group"
    _, _, _, x, y = results[0]
    torch.testing.assert_close(y, _nested_model()(x).detach())


# --------------------------------------------------------------- test_ddp_inference / test_ddp_sync_bn_training_vs_eval


def _test_inference(rank, world_size):
    syncbn_model = SyncBatchNorm(2, momentum=0.99, track_running_stats=False)
    local_syncbn_model = copy.deepcopy(syncbn_model)
    syncbn_model = DistributedDataParallel(syncbn_model)
    inp = torch.randn(10, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    outputs, local_outputs, collectives = [], [], 0
    if rank == 0:  # only rank 0 runs inference: a collective would hang
        syncbn_model.eval()
        local_syncbn_model.eval()
        with count_collectives(("all_reduce", "all_gather")) as counts:
            for _ in range(6):
                outputs.append(syncbn_model(inp).detach())
                local_outputs.append(local_syncbn_model(inp).detach())
        collectives = sum(counts.calls.values())
    dist.barrier()
    return inp, outputs, local_outputs, collectives


def test_inference_on_one_rank(dist_pool):
    inp, outputs, local_outputs, collectives = dist_pool.run(_test_inference)[0]
    assert collectives == 0, f"{collectives} collective(s) in eval mode"
    assert len(outputs) == 6
    plain = nn.BatchNorm2d(2, momentum=0.99, track_running_stats=False).eval()  # batch statistics, this rank only
    for out, local in zip(outputs, local_outputs, strict=True):
        torch.testing.assert_close(out, local)
        torch.testing.assert_close(out, plain(inp))


def _test_training_vs_eval(rank, world_size):
    model = DistributedDataParallel(SyncBatchNorm(2, momentum=0.99, track_running_stats=False))
    gen = torch.Generator().manual_seed(10 + rank)
    with count_collectives(("all_reduce", "all_gather")) as training:
        for _ in range(6):
            model(torch.randn(10, 2, 4, 4, generator=gen)).sum().backward()
    evaluated, eval_collectives = [], 0
    if rank == 0:
        model_inference = model.module
        model_inference.eval()
        with count_collectives(("all_reduce", "all_gather")) as evaluation:
            for _ in range(6):
                inp = torch.randn(10, 2, 4, 4, generator=gen)
                out = model_inference(inp)
                out.sum().backward()
                evaluated.append((inp, out.detach()))
        eval_collectives = sum(evaluation.calls.values())
    dist.barrier()
    return sum(training.calls.values()), eval_collectives, evaluated


def test_training_vs_eval(dist_pool):
    results = dist_pool.run(_test_training_vs_eval)
    plain = nn.BatchNorm2d(2, momentum=0.99, track_running_stats=False).eval()
    for rank, (training_collectives, eval_collectives, _) in enumerate(results):
        assert training_collectives > 0, f"rank {rank}: no synchronization in training mode"
        assert eval_collectives == 0, f"rank {rank}: {eval_collectives} collective(s) in eval mode"
    assert len(results[0][2]) == 6
    for inp, out in results[0][2]:
        torch.testing.assert_close(out, plain(inp))


# ---------------------------------------------------------------- test_ddp_uneven_inputs_stop_iteration_sync_bn


def _test_uneven_inputs_stop_iteration(rank, world_size):
    torch.manual_seed(0)
    model = DistributedDataParallel(convert_sync_batchnorm(copy.deepcopy(BatchNormNet())))
    model_input = torch.randn(10, 2, generator=torch.Generator().manual_seed(4))
    min_num_iters = 5
    num_iters = min_num_iters if rank != 0 else min_num_iters * 2  # rank 1 terminates early
    n, message = 0, None
    try:
        with model.join(throw_on_early_termination=True):
            for _ in range(num_iters):
                model(model_input).sum().backward()
                _model_step(model, zero_grad=False)
                n += 1
    except RuntimeError as err:
        message = str(err)
    # torch's validate_net_equivalence: every state_dict tensor equal on every rank
    equal = []
    for t in model.module.state_dict().values():
        gathered = [torch.zeros_like(t) for _ in range(world_size)]
        dist.all_gather(gathered, t)
        equal.append(all(torch.equal(g, t) for g in gathered))
    return n, message, all(equal)


def test_uneven_inputs_stop_iteration(dist_pool):
    results = dist_pool.run(_test_uneven_inputs_stop_iteration)
    for rank, (n, message, equal) in enumerate(results):
        assert n == 5, f"rank {rank} ran {n} iterations"
        expected = (
            "Detected at least one rank that exhausted inputs." if rank == 0 else f"Rank {rank} exhausted all inputs"
        )
        assert message is not None and expected in message, f"rank {rank}: {message!r}"
        assert equal, f"rank {rank}: the models differ across ranks"


# ---------------------------------------------------------------- test_sync_bn_logged (deliberately different)


def _test_sync_bn_logged(rank, world_size):
    model = BatchNormNet()
    no_sync_bn = DistributedDataParallel(copy.deepcopy(model))
    plain_logged = no_sync_bn._get_ddp_logging_data().get("has_sync_bn", True)
    ours = convert_sync_batchnorm(copy.deepcopy(model))
    model_ddp = DistributedDataParallel(ours)
    ours_logged = model_ddp._get_ddp_logging_data().get("has_sync_bn", True)
    try:
        DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model)))
        torch_error = None
    except ValueError as err:
        torch_error = str(err)
    dist.barrier()
    return bool(plain_logged), bool(ours_logged), torch_error, isinstance(ours.bn, nn.SyncBatchNorm)


def test_ddp_accepts_converted_layers_on_cpu(dist_pool):
    for plain_logged, ours_logged, torch_error, is_torch_syncbn in dist_pool.run(_test_sync_bn_logged):
        assert not plain_logged
        assert not is_torch_syncbn and not ours_logged, "our layers are not torch.nn.SyncBatchNorm, DDP logs no sync bn"
        assert torch_error is not None and "SyncBatchNorm layers only work with GPU modules" in torch_error
