"""Under torchrun the store is the agent's, not rank 0's: a stopped rank 0 is named as stopped (issue 50).

Under the pack's launcher rank 0 hosts the job's store, so a rank 0 stopped by SIGSTOP is seen as "the
job's store (hosted there) does not answer" (``tests/lightning/test_liveness.py``, sigstop-0). Under
torchrun the elastic agent hosts it and rank 0 is a client like any rank: the store answers, rank 0's
record stops, and rank 1 must name rank 0's process as stopped, in one line, and end the job at the end
limit with the rescue checkpoint. Limits of 2 s and 5 s stand for the defaults' 30 s and 300 s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from ddp_plugins.testing import free_port, loopback_env
from tests.helpers import REPO_ROOT

SCRIPT = """\
import os, signal, sys
import lightning.pytorch as pl
import torch
from ddp_plugins import DDPPluginsStrategy

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        if self.global_step == 6 and self.global_rank == 0:
            print(f"STOPPING {os.getpid()}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(160, 8), torch.randint(0, 2, (160,)))
        return torch.utils.data.DataLoader(data, batch_size=4)

trainer = pl.Trainer(
    accelerator="cpu", devices=2, max_steps=16, default_root_dir=sys.argv[1], enable_progress_bar=False,
    logger=False, enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
    strategy=DDPPluginsStrategy(backend="gloo", stall_name_after=2, stall_end_after=5),
)
trainer.fit(Net())
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.e2e
def test_a_stopped_rank_0_under_torchrun_is_named_stopped_and_the_job_ends(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", "script.py", str(tmp_path / "run"),
    ]  # fmt: skip
    env = loopback_env({**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    start = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=120)
        took = time.monotonic() - start
        stopped = next((line.split()[1] for line in output.splitlines() if line.startswith("STOPPING ")), "0")
        outlived = stopped != "0" and os.path.exists(f"/proc/{stopped}")  # before this test's own cleanup
    finally:  # a hang leaves no rank behind (SIGKILL ends a stopped process too)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode != 0, output[-4000:]
    named = [line for line in output.splitlines() if line.startswith("error: rank 0 (PID ")]
    assert len(named) == 1, output[-4000:]
    assert "its process is stopped (SIGSTOP or a debugger)" in named[0], named[0]
    assert "does not answer" not in output, "the agent's store answers: rank 0 is not its host"
    assert f"PID {stopped} " in named[0], (stopped, named[0])
    assert "error: ending every rank; checkpoint of the last completed step" in output, output[-4000:]
    assert list((tmp_path / "run").rglob("step-*-stalled.ckpt")), "no rescue checkpoint"
    assert not outlived, "the stopped rank 0 outlived its job"
    assert took < 90, f"the job took {took:.0f} s"
