"""A Hydra ``-m`` sweep of 2-rank jobs in a user's own Hydra app, not the pack's (issue 52).

The app is the user's: its own ``@hydra.main``, its own module, a ``Trainer`` built with
``DDPPluginsStrategy(child_command=job_subprocess_cmd)`` as docs/plugins.md says, ``fit`` then ``test``
in each job. Lightning keeps the process group and its launch variables after a job, so the second
job reused the first job's group, whose child rank had exited: gloo's "Connection closed by peer".
Each job must start its own child rank and group, and keep them from its ``fit`` to its ``test``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys

import pytest

from ddp_plugins.testing import loopback_env
from tests.helpers import REPO_ROOT

APP = """\
import os
import sys

import hydra
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugins import DDPPluginsStrategy
from ddp_plugins.app.hydra_args import job_subprocess_cmd


class Net(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr, self.net = lr, nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def test_step(self, batch, batch_idx):
        self.log("test/loss", nn.functional.cross_entropy(self.net(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@hydra.main(config_path=None, config_name=None, version_base="1.3")
def main(cfg: DictConfig) -> None:
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)), 8)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=DDPPluginsStrategy(backend="gloo", child_command=job_subprocess_cmd),
    )
    model = Net(cfg.lr)
    trainer.fit(model, data)
    group = id(dist.group.WORLD)
    trainer.test(model, data, verbose=False)
    kept = id(dist.group.WORLD) == group
    # one write of the whole line: the ranks share the pipe, and print's text and newline are two writes
    line = f"JOB lr={cfg.lr} rank={trainer.global_rank} pid={os.getpid()} group={dist.get_world_size()} kept={kept}\\n"
    sys.stdout.flush()
    os.write(1, line.encode())


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.e2e
def test_each_job_of_a_sweep_in_a_users_own_hydra_app_starts_its_own_ranks_and_group(tmp_path):
    (tmp_path / "user_app.py").write_text(APP)
    env = loopback_env({**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    command = [sys.executable, "user_app.py", "-m", "+lr=0.1,0.2", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=200)
    finally:  # a hang leaves no rank behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, stderr[-4000:]
    jobs = re.findall(r"JOB lr=(\S+) rank=(\d) pid=(\d+) group=(\d+) kept=(\w+)", stdout)
    assert sorted((lr, rank) for lr, rank, *_ in jobs) == [("0.1", "0"), ("0.1", "1"), ("0.2", "0"), ("0.2", "1")], (
        stdout[-3000:] + stderr[-3000:]
    )
    assert {(group, kept) for *_, group, kept in jobs} == {("2", "True")}, jobs  # fit and test in one group
    pids = {(lr, rank): pid for lr, rank, pid, *_ in jobs}
    assert pids[("0.1", "0")] == pids[("0.2", "0")], "the sweep's jobs run in the launching process"
    assert pids[("0.1", "1")] != pids[("0.2", "1")], "each job starts its own child rank"
