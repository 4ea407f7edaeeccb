"""SyncBatchNorm (core) on CPU/gloo equals single-process BatchNorm on the global batch; conversion keeps classes.

The Lightning callback and plugin are tested in tests/lightning/test_sync_batchnorm.py.
"""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp_plugins import _compat
from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.core.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from tests.helpers.collectives import count_collectives

TOL = {"atol": 1e-5, "rtol": 1e-5}
CHANNELS = 3
# (BatchNorm class, per-sample shape after the channel dim, memory format)
SHAPES = {
    "1d-flat": (nn.BatchNorm1d, (), None),
    "1d": (nn.BatchNorm1d, (4,), None),
    "2d": (nn.BatchNorm2d, (4, 3), None),
    "3d": (nn.BatchNorm3d, (2, 3, 2), None),
    "2d-channels_last": (nn.BatchNorm2d, (4, 3), torch.channels_last),
    "3d-channels_last": (nn.BatchNorm3d, (2, 3, 2), torch.channels_last_3d),
}


# --- layers used by the conversion tests (module level so the spawned ranks can import them) ---


class BNAct(nn.BatchNorm2d):
    """A BatchNorm+activation subclass: its own forward must survive conversion."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.slope = 0.2

    def forward(self, x):
        return F.leaky_relu(super().forward(x), self.slope)


class GainNorm(nn.Module):
    """BN-like, not a _BatchNorm: `normalize` is batch norm, `forward` adds a learned gain."""

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, 1e-5, 0.1
        self.affine, self.track_running_stats = True, True
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.gain = nn.Parameter(torch.tensor(2.0))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def normalize(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps
        )

    def forward(self, x):
        return self.gain * self.normalize(x)


class NotANorm(nn.Module):
    """Declared as batch norm by mistake: it has none of the statistics."""

    def forward(self, x):
        return x


def _mixed_net() -> nn.Module:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Conv2d(2, CHANNELS, 1), BNAct(CHANNELS), GainNorm(CHANNELS), nn.BatchNorm2d(CHANNELS))
    with torch.no_grad():
        for layer in net[1:]:
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-0.5, 0.5)
    return net


def _global_batch(sizes, feature_shape, steps, seed=0):
    """Per step, the global input and the upstream gradient, to be split by rank."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    return [
        (
            torch.randn(total, CHANNELS, *feature_shape, generator=gen) * 3 + 1,
            torch.randn(total, CHANNELS, *feature_shape, generator=gen),
        )
        for _ in range(steps)
    ]


def _train(layer, xs_and_grads, memory_format, reduce_grads, lr=0.1):
    """Forward, backward of sum(y * g), then an SGD step with the (globally summed) parameter gradients."""
    record = []
    for x, g in xs_and_grads:
        x = x.clone()
        if memory_format is not None:
            x = x.contiguous(memory_format=memory_format)
        x.requires_grad_(True)
        y = layer(x)
        (y * g).sum().backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        reduce_grads(grads)
        with torch.no_grad():
            for p, grad in zip(layer.parameters(), grads, strict=True):
                p -= lr * grad
                p.grad = None
        record.append({"y": y.detach(), "dx": x.grad, "dparams": grads})
    buffers = {name: b.clone() for name, b in layer.named_buffers()}
    return record, buffers


def _make_layer(kind, momentum, affine=True, track=True):
    cls = SHAPES[kind][0]
    torch.manual_seed(1)
    layer = cls(CHANNELS, momentum=momentum, affine=affine, track_running_stats=track)
    if affine:
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-0.5, 0.5)
    return layer


def _slice(sizes, rank):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _all_reduce_list(tensors):
    for t in tensors:
        dist.all_reduce(t)


# --- distributed equivalence ---


def _test_train_steps(rank, world_size, kind, sizes, momentum, affine, track, steps):
    _, feature_shape, memory_format = SHAPES[kind]
    layer = convert_sync_batchnorm(_make_layer(kind, momentum, affine, track))
    data = [(x[_slice(sizes, rank)], g[_slice(sizes, rank)]) for x, g in _global_batch(sizes, feature_shape, steps)]
    with count_collectives(("all_reduce", "all_gather")) as counts:
        record, buffers = _train(layer, data, memory_format, _all_reduce_list)
    return record, buffers, {"all_reduce": counts.calls["all_reduce"], "all_gather": counts.calls["all_gather"]}


CASES = [
    pytest.param(kind, sizes, momentum, id=f"{kind}-{sizes[0]}+{sizes[1]}-m{momentum}")
    for kind in SHAPES
    for sizes, momentum in [((3, 5), 0.1), ((0, 4), None)]
]


@pytest.mark.parametrize(("kind", "sizes", "momentum"), CASES)
def test_matches_batchnorm_on_the_global_batch(dist_pool, kind, sizes, momentum):
    steps = 3
    results = dist_pool.run(_test_train_steps, kind, sizes, momentum, True, True, steps)
    _, feature_shape, memory_format = SHAPES[kind]
    reference = _make_layer(kind, momentum)
    global_batch = _global_batch(sizes, feature_shape, steps)
    ref_record, ref_buffers = _train(reference, global_batch, memory_format, lambda g: None)
    for rank, (record, buffers, counts) in enumerate(results):
        part = _slice(sizes, rank)
        for step, (got, want) in enumerate(zip(record, ref_record, strict=True)):
            torch.testing.assert_close(got["y"], want["y"][part], **TOL, msg=f"output, rank {rank} step {step}")
            torch.testing.assert_close(got["dx"], want["dx"][part], **TOL, msg=f"input grad, rank {rank} step {step}")
            for i, (g, w) in enumerate(zip(got["dparams"], want["dparams"], strict=True)):
                torch.testing.assert_close(g, w, **TOL, msg=f"param {i} grad (summed over ranks), step {step}")
        for name, want in ref_buffers.items():
            torch.testing.assert_close(buffers[name], want, **TOL, msg=f"{name} on rank {rank}")
        assert counts == {"all_reduce": 2 * steps + 2 * steps, "all_gather": 0}, (
            f"expected 1 all_reduce in forward and 1 in backward per step (+2 for the test's grad sums), got {counts}"
        )


@pytest.mark.parametrize(("affine", "track"), [(False, True), (True, False), (False, False)])
def test_matches_without_affine_or_running_stats(dist_pool, affine, track):
    sizes, steps, kind = (3, 5), 2, "2d"
    results = dist_pool.run(_test_train_steps, kind, sizes, 0.1, affine, track, steps)
    reference = _make_layer(kind, 0.1, affine, track)
    ref_record, ref_buffers = _train(reference, _global_batch(sizes, SHAPES[kind][1], steps), None, lambda g: None)
    for rank, (record, buffers, _) in enumerate(results):
        for got, want in zip(record, ref_record, strict=True):
            torch.testing.assert_close(got["y"], want["y"][_slice(sizes, rank)], **TOL)
            torch.testing.assert_close(got["dx"], want["dx"][_slice(sizes, rank)], **TOL)
        assert buffers.keys() == ref_buffers.keys()
        for name, want in ref_buffers.items():
            torch.testing.assert_close(buffers[name], want, **TOL)


def _test_eval_mode_communicates_nothing(rank, world_size):
    layer = convert_sync_batchnorm(_make_layer("2d", 0.1), skip_frozen=False)
    layer.running_mean.fill_(0.5)
    layer.running_var.fill_(2.0)
    layer.eval()

    with count_collectives() as counts:
        x = torch.randn(2 + 3 * rank, CHANNELS, 4, 3)  # different sizes on the two ranks
        y = layer(x).detach()
    dist.barrier()  # keeps one call per rank in the pool
    return x, y, sum(counts.calls.values())


def test_eval_mode_uses_running_stats_without_communication(dist_pool):
    reference = _make_layer("2d", 0.1)
    reference.running_mean.fill_(0.5)
    reference.running_var.fill_(2.0)
    reference.eval()
    for x, y, collectives in dist_pool.run(_test_eval_mode_communicates_nothing):
        assert collectives == 0, f"{collectives} collective(s) ran in eval mode"
        torch.testing.assert_close(y, reference(x), **TOL)


def _test_subclass_and_declared_class(rank, world_size, sizes):
    net = convert_sync_batchnorm(_mixed_net(), extra_classes={GainNorm: "normalize"})
    x, g = _global_batch(sizes, (2, 2), 1, seed=5)[0]
    x, g = x[:, :2], g  # the conv maps 2 input channels to CHANNELS
    x = x[_slice(sizes, rank)].clone().requires_grad_(True)
    y = net(x)
    (y * g[_slice(sizes, rank)]).sum().backward()
    return y.detach(), x.grad, {k: v.clone() for k, v in net.state_dict().items()}, [type(m).__name__ for m in net]


def test_subclass_forward_and_declared_class_are_synchronized(dist_pool):
    sizes = (3, 5)
    results = dist_pool.run(_test_subclass_and_declared_class, sizes)
    reference = _mixed_net()
    x, g = _global_batch(sizes, (2, 2), 1, seed=5)[0]
    x = x[:, :2].clone().requires_grad_(True)
    y = reference(x)
    (y * g).sum().backward()
    assert (y < 0).any(), "the subclass's leaky_relu should leave negative outputs"
    for rank, (y_r, dx_r, state, names) in enumerate(results):
        assert names == ["Conv2d", "SyncBNAct", "SyncGainNorm", "SyncBatchNorm2d"], names
        torch.testing.assert_close(y_r, y.detach()[_slice(sizes, rank)], **TOL)
        torch.testing.assert_close(dx_r, x.grad[_slice(sizes, rank)], **TOL)
        for key, want in reference.state_dict().items():
            torch.testing.assert_close(state[key], want, **TOL, msg=f"{key} on rank {rank}")


def _test_group_size(rank, world_size, group_size):
    try:
        layer = convert_sync_batchnorm(_make_layer("2d", 0.1), group_size=group_size)
    except ValueError as err:
        dist.barrier()  # keeps one call per rank in the pool
        return str(err)
    x = torch.randn(4, CHANNELS, 4, 3, generator=torch.Generator().manual_seed(rank))
    return x, layer(x).detach(), layer.running_var.clone()


def test_group_size_one_synchronizes_within_each_rank_only(dist_pool):
    for x, y, running_var in dist_pool.run(_test_group_size, 1):
        reference = _make_layer("2d", 0.1)
        torch.testing.assert_close(y, reference(x).detach(), **TOL)
        torch.testing.assert_close(running_var, reference.running_var, **TOL)


def test_group_size_that_does_not_divide_the_world_fails_on_every_rank(dist_pool):
    for message in dist_pool.run(_test_group_size, 3):
        assert message == "`group_size` should be a divisor of the world size 2, got 3.", message


# --- conversion in one process ---


def test_single_process_is_plain_batchnorm():
    torch.manual_seed(0)
    layer, reference = SyncBatchNorm(CHANNELS), nn.BatchNorm2d(CHANNELS)
    x = torch.randn(6, CHANNELS, 4, 4)
    torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=0)
    torch.testing.assert_close(layer.running_var, reference.running_var, rtol=0, atol=0)
    assert layer.state_dict().keys() == reference.state_dict().keys()


def test_frozen_layers_are_skipped_and_reported():
    net = nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm1d(4), nn.BatchNorm1d(4), nn.BatchNorm1d(4, affine=False))
    net[0].eval()
    net[1].requires_grad_(False)
    _, report = convert_sync_batchnorm(net, return_report=True)
    assert report.converted == ["2", "3"], "a layer without parameters is not frozen: it still learns statistics"
    assert report.skipped == {"0": "frozen: eval mode", "1": "frozen: no trainable parameters"}
    assert [type(m) for m in net[:2]] == [nn.BatchNorm1d, nn.BatchNorm1d], "frozen layers should keep their class"
    assert "skipped 2: 0 (frozen: eval mode)" in str(report)
    _, report = convert_sync_batchnorm(revert_sync_batchnorm(net), skip_frozen=False, return_report=True)
    assert report.converted == ["0", "1", "2", "3"] and not report.skipped


def _snapshot(net):
    """Per layer: name, class, attributes, and each parameter/buffer's identity and value."""
    rows = []
    for name, m in net.named_modules():
        tensors = {k: (id(v), v.clone()) for k, v in [*m._parameters.items(), *m._buffers.items()] if v is not None}
        rows.append((name, type(m), dict(m.__dict__), tensors))
    return rows


def test_revert_round_trip_is_bit_exact():
    net = nn.Sequential(_mixed_net(), nn.SyncBatchNorm(CHANNELS), nn.BatchNorm2d(CHANNELS, momentum=None))
    net[2].extra_attribute = "kept"
    before = _snapshot(net)
    _, report = convert_sync_batchnorm(net, extra_classes={GainNorm: "normalize"}, return_report=True)
    assert report.converted == ["0.1", "0.2", "0.3", "1", "2"]
    assert isinstance(net[0][1], BNAct) and isinstance(net[1], nn.SyncBatchNorm) and isinstance(net[2], SyncBatchNorm)
    assert net[2].extra_attribute == "kept"
    # a converted model survives pickling and deepcopy (what spawn launchers and EMA callbacks do)
    copies = [pickle.loads(pickle.dumps(net)), copy.deepcopy(net)]
    assert revert_sync_batchnorm(net) is net
    after = _snapshot(net)
    assert [(n, t) for n, t, _, _ in after] == [(n, t) for n, t, _, _ in before], "classes not restored"
    for (name, _, attrs_b, tensors_b), (_, _, attrs_a, tensors_a) in zip(before, after, strict=True):
        assert attrs_a.keys() == attrs_b.keys(), f"attributes of {name!r} changed"
        for key, (ident, value) in tensors_b.items():
            assert tensors_a[key][0] == ident, f"{name}.{key} is a different tensor"
            assert torch.equal(tensors_a[key][1], value) and tensors_a[key][1].dtype == value.dtype
    for clone in copies:
        revert_sync_batchnorm(clone)
        assert [type(m) for m in clone.modules()] == [type(m) for m in net.modules()]
        for (k, a), b in zip(clone.state_dict().items(), net.state_dict().values(), strict=True):
            assert torch.equal(a, b), k


def test_converted_model_trains_and_its_state_dict_loads_into_the_original():
    original = _mixed_net()
    net = convert_sync_batchnorm(copy.deepcopy(original), extra_classes={GainNorm: "normalize"})
    x = torch.randn(8, 2, 3, 3)
    net(x).sum().backward()
    original(x).sum().backward()
    restored = _mixed_net()
    restored.load_state_dict(net.state_dict(), strict=True)
    for (key, a), b in zip(restored.state_dict().items(), original.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)


def test_declared_class_without_statistics_is_a_clear_error():
    with pytest.raises(ValueError, match=r"declares NotANorm as batch norm, but layer '0' lacks what SyncBatchNorm"):
        convert_sync_batchnorm(nn.Sequential(NotANorm()), extra_classes=[NotANorm])
    with pytest.raises(ValueError, match=r"`extra_classes` should be the name of a method of GainNorm .*'normalise'"):
        convert_sync_batchnorm(nn.Sequential(GainNorm(2)), extra_classes={GainNorm: "normalise"})
    with pytest.raises(ValueError, match=r"`extra_classes` should be importable classes, got 'tests.nowhere.Norm', "):
        convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(2)), extra_classes=["tests.nowhere.Norm"])


def test_bad_group_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"`group_size` should be an integer >= 1 or None, got 0\."):
        convert_sync_batchnorm(nn.BatchNorm1d(2), group_size=0)
    with pytest.raises(ValueError, match=r"`group_size` needs an initialized process group"):
        convert_sync_batchnorm(nn.BatchNorm1d(2), group_size=2)
    with pytest.raises(ValueError, match=r"`group_size` should be None when `process_group` is given, got 2\."):
        convert_sync_batchnorm(nn.BatchNorm1d(2), process_group=object(), group_size=2)


def test_bias_false_is_a_weight_only_layer_or_refused_on_a_torch_without_it():
    """``bias=False`` (torch 2.13's weight-only batch norm) is kept; an older torch refuses it in one line."""
    if not _compat.BATCHNORM_TAKES_BIAS:
        with pytest.raises(ArgumentValueError, match=r"^`bias` should be True on torch .*needs torch 2\.13.*got False"):
            SyncBatchNorm(3, bias=False)
        return
    layer, rows = SyncBatchNorm(3, bias=False), torch.randn(8, 3)
    assert layer.bias is None and layer.weight is not None and "bias" not in layer.state_dict()
    expected = F.batch_norm(rows, None, None, layer.weight, None, training=True)
    torch.testing.assert_close(layer(rows), expected)
