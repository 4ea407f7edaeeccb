"""SyncBatchNorm under ``torch.compile`` on CPU/gloo: the graphs of plain batch norm, and its results.

The pack's SyncBN keeps the group's count a tensor (no ``.item()``), so a compiled model with it has as
many graphs as without it (issue 44: 6 graphs and 5 breaks against 1 on this net before). Dynamo turns
``dist.all_reduce`` into torch's functional all_reduce; ``backend="aot_eager"`` traces the backward
too, without a C++ compiler.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_plugins import _compat
from ddp_plugins.core.sync_batchnorm import convert_sync_batchnorm

TOL = {"atol": 1e-5, "rtol": 1e-5}
SIZES = (3, 5)  # rows per rank: uneven, so a rank's own statistics differ from the group's


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
        nn.BatchNorm1d(5),
    )


def _batches(steps: int, rows: slice = slice(None)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the input and the upstream gradient of the global batch, or of its ``rows``."""
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(steps):
        x, g = torch.randn(sum(SIZES), 3, 4, 4, generator=gen) * 2 + 1, torch.randn(sum(SIZES), 5, generator=gen)
        batches.append((x[rows], g[rows]))
    return batches


def _train(net: nn.Module, batches, reduce_grads, lr: float = 0.1) -> list[list[torch.Tensor]]:
    """Per step: the output, the input gradient and the (globally summed) parameter gradients; SGD in between."""
    record = []
    for x, g in batches:
        x = x.clone().requires_grad_(True)
        y = net(x)
        (y * g).sum().backward()
        grads = [p.grad.clone() for p in net.parameters()]
        reduce_grads(grads)
        with torch.no_grad():
            for p, grad in zip(net.parameters(), grads, strict=True):
                p -= lr * grad
                p.grad = None
        record.append([y.detach(), x.grad, *grads])
    return record


def _rows(rank: int) -> slice:
    start = sum(SIZES[:rank])
    return slice(start, start + SIZES[rank])


def _test_graph_counts(rank, world_size):
    counts = {}
    for name, net in [("plain", _net()), ("sync", convert_sync_batchnorm(_net()))]:
        torch.compiler.reset()
        graphs = []

        def count_graphs(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(net, backend=count_graphs)
        for x, g in _batches(2, _rows(rank)):  # a second step of the same shape compiles nothing new
            (compiled(x.clone().requires_grad_(True)) * g).sum().backward()
        counts[name] = len(graphs)
    torch.compiler.reset()
    return counts


@pytest.mark.skipif(not _compat.DYNAMO_TRACES_SYNCBN, reason="torch 2.10, 2.11: SyncBN runs eagerly (graph breaks)")
def test_compiled_syncbn_has_the_graphs_of_plain_batchnorm(dist_pool):
    for rank, counts in enumerate(dist_pool.run(_test_graph_counts)):
        assert counts["sync"] == counts["plain"], (
            f"rank {rank}: expected as many compiled graphs with SyncBatchNorm as without ({counts['plain']}),"
            f" got {counts['sync']}: a graph break in SyncBatchNorm (torch._dynamo.explain names it)"
        )


def _test_compiled_training(rank, world_size, steps):
    torch.compiler.reset()
    net = convert_sync_batchnorm(_net())
    # fullgraph: any graph break raises (torch 2.10, 2.11: SyncBN runs eagerly between the graphs)
    compiled = torch.compile(net, backend="aot_eager", fullgraph=_compat.DYNAMO_TRACES_SYNCBN)
    record = _train(compiled, _batches(steps, _rows(rank)), lambda grads: [dist.all_reduce(g) for g in grads])
    torch.compiler.reset()
    return record, {name: b.clone() for name, b in net.named_buffers()}


def test_compiled_syncbn_trains_as_batchnorm_on_the_global_batch(dist_pool):
    steps = 2
    results = dist_pool.run(_test_compiled_training, steps)
    reference = _net()
    ref_record = _train(reference, _batches(steps), lambda grads: None)
    for rank, (record, buffers) in enumerate(results):
        for step, (got, want) in enumerate(zip(record, ref_record, strict=True)):
            torch.testing.assert_close(got[0], want[0][_rows(rank)], **TOL, msg=f"output, rank {rank} step {step}")
            torch.testing.assert_close(got[1], want[1][_rows(rank)], **TOL, msg=f"input grad, rank {rank} step {step}")
            for i, (g, w) in enumerate(zip(got[2:], want[2:], strict=True)):
                torch.testing.assert_close(g, w, **TOL, msg=f"param {i} grad (summed over ranks), step {step}")
        for name, want in reference.named_buffers():
            torch.testing.assert_close(buffers[name], want, **TOL, msg=f"{name} on rank {rank}")


def _test_too_few_values(rank, world_size, sizes):
    layer = convert_sync_batchnorm(nn.BatchNorm1d(3))
    try:
        layer(torch.randn(sizes[rank], 3))
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize(("sizes", "total"), [((1, 0), 1), ((0, 0), None), ((1, 1), None)])
def test_fewer_than_two_values_over_the_group_fail_on_every_rank(dist_pool, sizes, total):
    """One value per channel over the group fails on every rank alike; none at all is an empty batch,
    which torch's BatchNorm takes (below)."""
    want = (
        None
        if total is None
        else f"Expected more than 1 value per channel when training, got {total} over the process group"
    )
    assert dist_pool.run(_test_too_few_values, sizes) == [want, want]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_running_var_update_by_a_tensor_factor_rounds_as_by_a_number(dtype):
    """``addcmul_`` by the 0-dim unbiased factor equals ``add_(alpha=factor)`` bit for bit (what the
    function did when the count was a Python number)."""
    gen = torch.Generator().manual_seed(0)
    for total in range(2, 200):
        running_var = (torch.rand(64, generator=gen, dtype=torch.float64) * 3).to(dtype)
        var = torch.rand(64, generator=gen, dtype=torch.float64) * 5
        count = torch.tensor(float(total), dtype=torch.float64)
        by_number = running_var.clone().mul_(0.9).add_(var, alpha=0.1 * total / (total - 1))
        by_tensor = running_var.clone().mul_(0.9).addcmul_(var, 0.1 * count / (count - 1))
        assert torch.equal(by_tensor, by_number), f"running_var differs for a count of {total} in {dtype}"


def _test_empty_everywhere(rank, world_size):
    layer = convert_sync_batchnorm(nn.BatchNorm2d(3))
    layer.weight.data.fill_(1.5)
    x = torch.zeros(0, 3, 4, 4, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    return y.shape, x.grad.shape, layer.weight.grad, layer.bias.grad, dict(layer.named_buffers())


def test_an_empty_batch_on_every_rank_is_torch_s_batchnorm_on_an_empty_batch(dist_pool):
    """A plan's empty micro-batch (a last step shorter than its accumulation) on every rank: an empty
    output, unchanged statistics and zero gradients, as one process's BatchNorm (the promise matrix's
    app cells on 2 and 3 ranks; 6581d93 raised "got 0 over the process group")."""
    plain = nn.BatchNorm2d(3)
    plain.weight.data.fill_(1.5)
    x = torch.zeros(0, 3, 4, 4, requires_grad=True)
    y = plain(x)
    y.sum().backward()
    for shape, grad_shape, weight_grad, bias_grad, buffers in dist_pool.run(_test_empty_everywhere):
        assert shape == y.shape and grad_shape == x.grad.shape
        torch.testing.assert_close(weight_grad, plain.weight.grad)
        torch.testing.assert_close(bias_grad, plain.bias.grad)
        for name, want in plain.named_buffers():
            torch.testing.assert_close(buffers[name], want, msg=name)
