"""The core in a raw torch DDP loop (torchrun) and under Lightning Fabric equals one process."""

import sys

import pytest
import torch
import torch.nn.functional as F

from ddp_plugins.testing import check_ok, free_port, loopback_env, run_command
from tests.core.scripts import torch_ddp
from tests.helpers import REPO_ROOT

SCRIPT = str(REPO_ROOT / "tests" / "core" / "scripts" / "torch_ddp.py")


def _reference() -> tuple[dict, torch.Tensor]:
    """One process, the global batch of 16 rows per step, plain BatchNorm."""
    net = torch_ddp.make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y, x_eval = torch_ddp.make_data()
    for step in range(torch_ddp.STEPS):
        optimizer.zero_grad()
        F.mse_loss(net(x[step]), y[step]).backward()
        optimizer.step()
    net.eval()
    with torch.no_grad():
        return net.state_dict(), net(x_eval)


def _check_against_reference(result: dict) -> None:
    state, preds = _reference()
    assert result["state"].keys() == state.keys(), "conversion must keep the state_dict keys"
    for key, want in state.items():
        torch.testing.assert_close(
            result["state"][key], want, rtol=1e-5, atol=1e-6, msg=f"{key} differs from one process"
        )
    torch.testing.assert_close(result["eval"]["preds"], preds, rtol=1e-5, atol=1e-6)
    assert result["eval"]["ids"] == [f"row{i}" for i in range(torch_ddp.EVAL_ROWS)], "rows out of order or padded"
    noises = result["noises"]
    assert noises.shape == (2, 3) and not torch.equal(noises[0], noises[1]), "ranks drew the same random stream"


@pytest.mark.slow
def test_raw_torch_ddp_under_torchrun_without_lightning(tmp_path):
    out = tmp_path / "result.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        SCRIPT,
        str(out),
    ]
    env = loopback_env(DDP_PLUGINS_BLOCK_LIGHTNING="1")
    check_ok(run_command(cmd, timeout=180, env=env))
    _check_against_reference(torch.load(out, weights_only=False))


@pytest.mark.slow
@pytest.mark.e2e
def test_lightning_fabric_with_the_core(tmp_path):
    out = tmp_path / "result.pt"
    env = loopback_env(MASTER_PORT=str(free_port()))
    check_ok(run_command([sys.executable, SCRIPT, str(out), "fabric"], timeout=180, env=env))
    _check_against_reference(torch.load(out, weights_only=False))


def test_the_core_imports_without_lightning():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric',"
        " 'lightning_utilities'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import ddp_plugins, ddp_plugins.core\n"
        "from ddp_plugins.core import convert_sync_batchnorm, distributed_concat, seed_everything_rank_aware\n"
        "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules)\n"
        "try:\n"
        "    ddp_plugins.DDPPluginsStrategy\n"
        "except ImportError:\n"
        "    print('adapters need lightning')\n"
    )
    result = check_ok(run_command([sys.executable, "-c", code], timeout=60, env=loopback_env()))
    assert result.stdout.strip() == "adapters need lightning", result.stdout
