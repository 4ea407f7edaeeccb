"""Exact epochs through the app: a run on a global plan stopped on 2 ranks resumes on 1 at the same row.

What the rows and gradients are is proven against one process in
``tests/lightning/test_global_plan.py``; here the app's path: ``global_batch_size``, a
SIGTERM stop, a resume with another ``trainer.devices`` that continues at the next global step,
and a resume that would skew the epoch, refused with one line before training.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

from tests.app.test_safety import _one_line_failure
from tests.helpers.multiprocess import check_ok, run_command

APP = [sys.executable, "-m", "ddp_plugins.train"]
PLANNED = [
    "data=synthetic", "data.num_samples=400", "model.channels=8", "data.num_workers=0", "trainer.max_epochs=2",
    "trainer.enable_progress_bar=false", "global_batch_size=48",
    "callbacks.accumulation_no_sync.accumulate_grad_batches=2",
]  # fmt: skip  # 320 training rows: 7 steps of 48 rows per epoch (the last has 32) in 2 micro-batches, on any N
STOP = [
    "+callbacks.interrupt._target_=tests.helpers.interrupt.SignalAt", "+callbacks.interrupt.hook=train_batch_end",
    "+callbacks.interrupt.step=3", "+callbacks.interrupt.rank=0", "+callbacks.interrupt.sig=SIGTERM",
    "+callbacks.interrupt.target=self",
]  # fmt: skip
RESUMING = re.compile(r"resuming from (\S+) \(epoch (\d+), step (\d+)\)(.*)")


@pytest.mark.slow
def test_a_planned_run_stopped_on_two_ranks_resumes_on_one_and_a_changed_plan_is_refused(tmp_path):
    folder = tmp_path / "run"
    cmd = [*APP, *PLANNED, f"hydra.run.dir={folder}"]
    stopped = run_command([*cmd, *STOP], timeout=300)
    assert stopped.returncode == 128 + 15, stopped.stderr[-4000:]

    changed = run_command([*cmd, "trainer.devices=1", "global_batch_size=32"], timeout=300)
    line = _one_line_failure(changed, 2)
    assert "global_batch_size 48 -> 32" in line and "the number of ranks may change" in line, line

    resumed = check_ok(run_command([*cmd, "trainer.devices=1"], timeout=300))
    position = RESUMING.search(resumed.stderr + resumed.stdout)
    said = (resumed.stderr + resumed.stdout)[-3000:]
    assert position and position.group(2, 3, 4) == ("0", "4", " on 1 rank (was 2)"), said
    final = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == 2 * 7 and final["epoch"] == 1
    record = final["ddp_plugins_data"]
    assert record["world_size"] == 1 and record["plan"]["global_batch_size"] == 48
    stop = torch.load(position.group(1), map_location="cpu", weights_only=True)["ddp_plugins_data"]
    assert (stop["world_size"], stop["epoch"], stop["rows_done"]) == (2, 0, 4 * 48)
