"""SyncBN in every floating dtype equals plain BatchNorm on the global batch in the same dtype (2 gloo ranks)."""

import pytest
import torch
from torch import nn

from ddp_plugins.core import convert_sync_batchnorm

# dtype -> (rtol, atol): torch's own tolerances for its SyncBatchNorm dtype tests are of this order
TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def _global_batch(dtype):
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(8, 3, 4, 4, generator=gen) * 2 + 1).to(dtype), torch.randn(8, 3, 4, 4, generator=gen).to(dtype)


def _layer(dtype):
    torch.manual_seed(5)
    layer = nn.BatchNorm2d(3).to(dtype)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    return layer


def _test_sync_matches_global(rank, world_size, dtype):
    x, dy = _global_batch(dtype)
    rows = slice(rank * 4, rank * 4 + 4)
    layer = convert_sync_batchnorm(_layer(dtype))
    xr = x[rows].clone().requires_grad_(True)
    out = layer(xr)
    out.backward(dy[rows])
    return out.detach(), xr.grad, layer.weight.grad, layer.bias.grad, layer.running_mean, layer.running_var


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_sync_batchnorm_equals_plain_batchnorm_on_the_global_batch(dist_pool, dtype):
    results = dist_pool.run(_test_sync_matches_global, dtype)
    x, dy = _global_batch(dtype)
    reference = _layer(dtype)
    xg = x.clone().requires_grad_(True)
    out = reference(xg)
    out.backward(dy)
    rtol, atol = TOLERANCES[dtype]
    for rank, (out_r, dx_r, _dw_r, _db_r, mean_r, var_r) in enumerate(results):
        rows = slice(rank * 4, rank * 4 + 4)
        assert out_r.dtype == dtype and dx_r.dtype == dtype, "outputs and gradients keep the input's dtype"
        torch.testing.assert_close(out_r, out[rows].detach(), rtol=rtol, atol=atol)
        torch.testing.assert_close(dx_r, xg.grad[rows], rtol=rtol, atol=atol)
        torch.testing.assert_close(mean_r, reference.running_mean, rtol=rtol, atol=atol)
        torch.testing.assert_close(var_r, reference.running_var, rtol=rtol, atol=atol)
    # weight/bias gradients stay local (DDP sums them): the ranks' sum is the global one
    torch.testing.assert_close(results[0][2] + results[1][2], reference.weight.grad, rtol=rtol * 4, atol=atol * 4)
    torch.testing.assert_close(results[0][3] + results[1][3], reference.bias.grad, rtol=rtol * 4, atol=atol * 4)
