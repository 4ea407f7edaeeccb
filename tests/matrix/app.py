"""The app entry of a promise-matrix cell: ``python -m ddp_plugins.train`` on the cell's ranks against
the same command on 1 rank (the plan trains the same rows at every step on any N, so that run is one
process on the same global batches), both started warm (tests/helpers/warm.py).

The model is the demo CNN made smooth (``tests.helpers.models.SmoothCNN``: tanh, average pooling, SGD
with momentum), with BatchNorm and the app's SyncBN callback, or without BatchNorm. Every default
callback stays on. Compared: the last checkpoint's parameters, buffers and optimizer state, every value
of metrics.csv (each step's and each epoch's, the all-reduce counts included), and the rows each rank
trained (``tests.helpers.ledger.RowLedger``): each row once per epoch, the same rows at every step.
The reproducible mode is compared bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from ddp_plugins.testing import check_ok
from tests.helpers.ledger import batches_of
from tests.helpers.runs import assert_equal_states, final_state, metrics_rows
from tests.helpers.shared import made_once
from tests.helpers.warm import APP, run_warm
from tests.matrix.table import TOLERANCE, VIRTUAL_SHARDS, refusal

TRAIN_ROWS = 48  # data.num_samples=60, of which 12 validate
SHORT_LAST = {2: 47, 3: 23, 4: 15}  # a global batch whose last step has N - 1 rows of 48
BATCH = {"divisible": 12, "not-divisible": 13}


def global_batch(cell: dict) -> int:
    return SHORT_LAST[cell["ranks"]] if cell["batch"] == "short-last" else BATCH[cell["batch"]]


def overrides(cell: dict, ranks: int) -> list[str]:
    bn = cell["syncbn"] == "on"
    return [
        "data=synthetic", "data.num_samples=60", "data.num_workers=0", "model.channels=4", "model.dropout=0",
        "model._target_=tests.helpers.models.SmoothCNN", f"+model.batchnorm={str(bn).lower()}",
        *([] if bn else ["~callbacks.sync_batchnorm"]), "+callbacks.ledger._target_=tests.helpers.ledger.RowLedger",
        "trainer.max_epochs=2", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "resume=never",
        f"global_batch_size={global_batch(cell)}", f"callbacks.accumulation_no_sync.accumulate_grad_batches="
        f"{cell['accumulation']}", f"precision={cell['precision']}", f"reproducible={cell['reproducible'] == 'on'}",
        f"strategy.virtual_shards={VIRTUAL_SHARDS}", f"trainer.devices={ranks}",
    ]  # fmt: skip


def _run(cell: dict, ranks: int, folder: Path):
    """The cell's command (its global batch is the cell's) on ``ranks`` ranks, warm."""
    return run_warm([*APP, *overrides(cell, ranks), f"hydra.run.dir={folder}"], timeout=300)


def _steps(folder: Path, ranks: int, epoch: int, accumulation: int) -> list[list[int]]:
    """The rows of each optimizer step of ``epoch`` over every rank (micro-batch ``b`` is in step ``b // K``)."""
    steps: dict[int, list[int]] = {}
    for rank in range(ranks):
        for b, rows in enumerate(batches_of(folder, rank, epoch)):
            steps.setdefault(b // accumulation, []).extend(rows)
    return [sorted(steps[s]) for s in sorted(steps)]


def check_app_cell(cell: dict, tmp: Path, factory: pytest.TempPathFactory) -> dict:
    """Run the cell through the app in ``tmp`` and check it against 1 rank; what the matrix records of it."""
    refused = refusal(cell)
    done = _run(cell, cell["ranks"], tmp / "run")
    if refused is not None:
        assert done.returncode == 2, f"expected a refusal (exit 2), got {done.returncode}:\n{done.stderr[-3000:]}"
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("error: ") and refused in line, line
        return {"outcome": f"refused: {line}"}
    check_ok(done)
    one = _reference(cell, factory)
    ours, ref = final_state(tmp / "run"), final_state(one)
    assert (ours["epoch"], ours["global_step"]) == (ref["epoch"], ref["global_step"])
    for epoch in range(2):
        trained = sorted(i for step in _steps(tmp / "run", cell["ranks"], epoch, 1) for i in step)
        assert trained == list(range(TRAIN_ROWS)), f"epoch {epoch}: rows padded, dropped or repeated"
        k = cell["accumulation"]
        by_step = _steps(tmp / "run", cell["ranks"], epoch, k)
        assert by_step == _steps(one, 1, epoch, k), f"epoch {epoch}: other rows at some step than on 1 rank"
    ours_rows, ref_rows = metrics_rows(tmp / "run"), metrics_rows(one)
    assert [sorted(r) for r in ours_rows] == [sorted(r) for r in ref_rows], "metrics.csv logs other values"
    if cell["reproducible"] == "on":
        assert_equal_states(ours["state_dict"], ref["state_dict"], "state_dict")
        assert_equal_states(ours["optimizer_states"], ref["optimizer_states"], "optimizer_states")
        assert ours_rows == ref_rows, "metrics.csv: not the bits of 1 rank"
        return {"outcome": "the same bits as on 1 rank"}
    tol = TOLERANCE[cell["precision"]]
    torch.testing.assert_close(ours["state_dict"], ref["state_dict"], rtol=tol, atol=tol)
    torch.testing.assert_close(ours["optimizer_states"][0]["state"], ref["optimizer_states"][0]["state"], rtol=tol,
                               atol=tol)  # fmt: skip
    for index, (a, b) in enumerate(zip(ours_rows, ref_rows, strict=True)):
        for key in a:
            x, y = float(a[key]), float(b[key])
            same = math.isclose(x, y, rel_tol=tol, abs_tol=tol) or math.isnan(x) and math.isnan(y)  # an empty step's
            assert same, f"metrics.csv row {index}, {key}: {x} != {y} (1 rank)"
    rounds = [float(r["comm/allreduce_rounds"]) for r in ours_rows if "comm/allreduce_rounds" in r]
    assert rounds and set(rounds) == {1.0}, f"gradient all-reduce rounds per optimizer step: {rounds}"
    return {"outcome": "equal to one process"}


def _reference(cell: dict, factory: pytest.TempPathFactory) -> Path:
    """The same command on 1 rank, made once per test run (shared by the xdist workers)."""
    same = {**cell, "ranks": 1, "global_batch": global_batch(cell)}
    key = hashlib.sha1(json.dumps(same, sort_keys=True).encode()).hexdigest()[:12]

    def make(folder: Path) -> None:
        check_ok(_run(cell, 1, folder / "run"))  # the cell's global batch, on 1 rank

    return made_once(factory, f"matrix-app-{key}", make) / "run"
