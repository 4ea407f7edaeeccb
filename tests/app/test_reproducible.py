"""The reproducible mode through the app: stopped by SIGTERM on 2 ranks, resumed on 3, the same bits as 1.

``reproducible=true`` with the app's default callbacks (SyncBN on: it steps aside, BatchNorm
normalizes per virtual shard), dropout, Adam and a cosine schedule in float32: the run stopped on
2 ranks at step 4 and resumed on 3 ends with the parameters, buffers, optimizer state, logged
metrics and fingerprint of one uninterrupted rank. The Lightning-level proof on 1 to 4 ranks is
``tests/lightning/test_reproducible.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

from ddp_plugins.lightning.reproducible import FINGERPRINT_KEY
from ddp_plugins.testing import check_ok
from tests.app.test_exact_epochs import STOP
from tests.app.test_safety import _one_line_failure
from tests.helpers.runs import assert_equal_states, final_state, metrics_rows
from tests.helpers.warm import APP, run_warm

RUN = [
    "data=synthetic", "data.num_samples=400", "model.channels=8", "model.dropout=0.2", "data.num_workers=0",
    "trainer.max_epochs=2", "trainer.enable_progress_bar=false", "global_batch_size=48", "reproducible=true",
]  # fmt: skip  # 320 training rows: 7 steps of 48 rows per epoch (the last has 32), 8 virtual shards of 6 or 4
FINGERPRINT = re.compile(r"state fingerprint: ([0-9a-f]{32})")


def _fingerprint(result) -> str:
    found = FINGERPRINT.search(result.stdout)
    assert found, (result.stdout + result.stderr)[-3000:]
    return found.group(1)


@pytest.mark.slow
@pytest.mark.e2e
def test_stopped_on_two_ranks_resumed_on_three_equals_one_rank(tmp_path):
    one = check_ok(run_warm([*APP, *RUN, "trainer.devices=1", f"hydra.run.dir={tmp_path / 'one'}"], timeout=300))
    cmd = [*APP, *RUN, f"hydra.run.dir={tmp_path / 'moved'}"]
    stopped = run_warm([*cmd, *STOP, "trainer.devices=2"], timeout=300)
    assert stopped.returncode == 128 + 15, stopped.stderr[-4000:]
    resumed = check_ok(run_warm([*cmd, "trainer.devices=3"], timeout=300))
    assert "on 3 ranks (was 2)" in resumed.stdout + resumed.stderr
    for run in (one, resumed):  # the exactly combined values are not "to be synced" (Lightning's hint)
        assert "It is recommended to use `self.log('val/loss'" not in run.stderr, run.stderr[-3000:]

    assert _fingerprint(resumed) == _fingerprint(one)
    assert_equal_states(final_state(tmp_path / "moved"), final_state(tmp_path / "one"))
    last = torch.load(tmp_path / "one" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last[FINGERPRINT_KEY] == _fingerprint(one)  # a checkpoint names the state it holds
    names = ("epoch", "step", "val/loss", "val/exact_acc", "train/loss")
    logged = [{k: v for k, v in row.items() if k in names} for row in metrics_rows(tmp_path / "one")]
    resumed_rows = [{k: v for k, v in row.items() if k in names} for row in metrics_rows(tmp_path / "moved")]
    for name in ("val/loss", "train/loss"):  # every step's training loss, bit for bit, across the move
        assert [r for r in logged if name in r] == [r for r in resumed_rows if name in r], name


def test_the_modes_limits_are_one_line_each(tmp_path):
    common = [*APP, "data=synthetic", "data.num_samples=400", f"hydra.run.dir={tmp_path}", "reproducible=true"]
    cases = {
        "needs_global_batch": ([], "global_batch_size got None, allowed: an integer with reproducible=True"),
        "too_many_ranks": (
            ["global_batch_size=48", "strategy.virtual_shards=2", "trainer.devices=3"],
            "at most virtual_shards=2 ranks",
        ),
        "float16": (
            ["global_batch_size=48", "precision=16-mixed"],
            "16-mixed",
        ),
        "accumulation": (
            ["global_batch_size=48", "callbacks.accumulation_no_sync.accumulate_grad_batches=2"],
            "accumulate_grad_batches got 2",
        ),
        "short_last_step": (["global_batch_size=63"], "got 63: 320 rows leave a last step of 5 rows"),
        "comm_hook": (["global_batch_size=48", "strategy.comm_hook=fp16"], "'none' with reproducible=True"),
        "shards_larger_than_steps": (
            ["global_batch_size=48", "strategy.virtual_shards=64"],
            "fewer rows than shards in every step",
        ),
    }
    for name, (args, expected) in cases.items():
        line = _one_line_failure(run_warm([*common, *args], timeout=120), 2)
        assert expected in line, f"{name}: {line}"


def test_shards_too_small_for_batchnorm1d_are_refused_before_any_rank_starts(tmp_path):
    """320 training rows in steps of 50 leave a last step of 20, which 16 shards cut into shards of 1 row: a
    BatchNorm1d cannot normalize one. At a1c30de the app started its ranks, ran the sanity validation and
    failed at the first training step."""
    folder = tmp_path / "run"
    result = run_warm(
        [*APP, "data=synthetic", "data.num_samples=400", "model.channels=8", "trainer.max_epochs=1",
         "model._target_=tests.helpers.models.BatchNorm1dHeadCNN", "reproducible=true", "global_batch_size=50",
         "strategy.virtual_shards=16", f"hydra.run.dir={folder}"],
        timeout=120,
    )  # fmt: skip
    line = _one_line_failure(result, 2)  # the app's up-front refusal (a rank's failure exits 1)
    assert line.startswith("error: strategy.virtual_shards got 16: step 6 has 20 rows"), line
    assert "BatchNorm1d 'head.0'" in line, line
    assert not folder.exists(), "a refused start makes no run folder"
