"""The promise matrix's cells (tests/matrix/table.py), each against one process.

``make test`` runs the pairwise subset; ``DDP_PLUGINS_MATRIX=full`` (``make test-matrix``) every cell.
With ``DDP_PLUGINS_MATRIX_RESULTS=<file>`` each cell appends its outcome and seconds to that file, from
which ``python -m tests.matrix.report`` writes docs/promise_matrix.md.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time

import pytest
import torch

from ddp_plugins.testing import run_lightning
from tests.matrix import job
from tests.matrix.app import check_app_cell
from tests.matrix.table import TOLERANCE, cell_id, pairwise, product, refusal

CELLS = product() if os.environ.get("DDP_PLUGINS_MATRIX") == "full" else pairwise()


@pytest.fixture
def record(request):
    """Append the cell's outcome to ``$DDP_PLUGINS_MATRIX_RESULTS`` (one JSON line), if set."""
    results, began = os.environ.get("DDP_PLUGINS_MATRIX_RESULTS"), time.monotonic()
    outcome: dict = {}
    yield outcome
    if results:
        report = getattr(request.node, "matrix_report", None)  # tests/matrix/conftest.py
        passed = report is not None and report.passed
        if not passed:
            errors = [line for line in getattr(report, "longreprtext", "").splitlines() if line.startswith("E ")]
            outcome["outcome"] = f"FAILED: {errors[0][1:].strip() if errors else 'see the test log'}"
        line = {**outcome, "seconds": round(time.monotonic() - began, 1), "passed": passed}
        with open(results, "a") as file:
            file.write(json.dumps(line) + "\n")


@functools.cache
def _run(key: str) -> list[dict]:
    """The cell's ranks' results (cached: a reproducible cell is compared with another N's run of it)."""
    cell = json.loads(key)
    if cell["flow"] != "resume-n":
        return run_lightning(job.run, cell, world_size=cell["ranks"], timeout=240)
    with tempfile.TemporaryDirectory(prefix="ddp_plugins_resume_n_") as keep:  # the checkpoints, metrics.csv
        stopped = run_lightning(job.run, cell, keep, world_size=cell["ranks"], timeout=240)
        if "refused" in stopped[0]:
            return stopped
        path = stopped[0]["resume_from"]
        resumed = run_lightning(job.run, cell, keep, path, world_size=job.other_ranks(cell["ranks"]), timeout=240)
    if any("refused" in result for result in resumed):
        return resumed
    # one run: rank 0 what rank 0 did and logged before the stop and after, the state where it ended
    first, before = stopped[0], stopped[1:]
    joined = {key: first[key] + resumed[0][key] for key in ("seen", "step_values", "logged", "rounds")}
    return [{**resumed[0], **joined, "before": before}, *resumed[1:]]


def _close(actual, expected, tol: float, what: str) -> None:
    torch.testing.assert_close(
        actual, expected, rtol=tol, atol=tol, check_dtype=False, equal_nan=True, msg=lambda m: f"{what}: {m}"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_the_cell_equals_one_process(cell, record, tmp_path, tmp_path_factory):
    record.update(cell=cell_id(cell))
    if cell["entry"] == "app":
        record.update(check_app_cell(cell, tmp_path, tmp_path_factory))
        return
    ranks = _run(json.dumps(cell, sort_keys=True))
    refused = refusal(cell)
    if refused is not None:
        for rank, result in enumerate(ranks):
            assert result.get("refused", "").startswith(refused), f"rank {rank}: expected a refusal, got {result}"
        record.update(outcome=f"refused: {ranks[0]['refused']}")
        return
    assert not any("refused" in r for r in ranks), f"refused: {ranks[0].get('refused')}"
    for rank, result in enumerate(ranks[1:], 1):
        _close(result["state"], ranks[0]["state"], 0.0, f"rank {rank}'s state against rank 0's")
    steps = job.global_steps(ranks)
    epochs = job.EPOCHS
    assert len(steps) % epochs == 0, f"{len(steps)} optimizer steps over {epochs} epochs"
    per_epoch = len(steps) // epochs
    rows, planned = job.sizes(cell)
    for epoch in range(epochs):
        trained = sorted(i for step in steps[epoch * per_epoch : (epoch + 1) * per_epoch] for m in step for i in m)
        assert trained == list(range(rows)), f"epoch {epoch}: rows padded, dropped or repeated"
        if planned is not None:
            got = [sorted(i for m in step for i in m) for step in steps[epoch * per_epoch : (epoch + 1) * per_epoch]]
            assert got == job.planned_rows(cell, epoch), f"epoch {epoch}: the steps' rows are not the plan's"
    if cell["flow"] != "fit":
        _check_logs_kept(ranks[0])
    if cell["reproducible"] == "on":
        _check_bits(cell, ranks)
        record.update(outcome="the same bits as on another number of ranks")
        return
    _check_against_reference(cell, ranks, steps, per_epoch)
    record.update(outcome="equal to one process")


def _check_bits(cell: dict, ranks: list[dict]) -> None:
    """The reproducible mode: bitwise the run of the same cell on another number of ranks."""
    other = 2 if cell["ranks"] == 1 else 1
    (reference, *_) = _run(json.dumps({**cell, "ranks": other}, sort_keys=True))
    for key in ("state", "momentum", "logged", "flow_logged", "best", "predictions"):
        assert _bits(ranks[0].get(key)) == _bits(reference.get(key)), f"{key}: not the bits of {other} rank(s)"


def _bits(value):
    if isinstance(value, torch.Tensor):
        return value.view(-1).tolist() if value.is_floating_point() else value.tolist()
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_bits(v) for v in value]
    return value


def _check_against_reference(cell: dict, ranks: list[dict], steps: list, per_epoch: int) -> None:
    tol = TOLERANCE[cell["precision"]]
    ref = job.reference(cell, steps, per_epoch)
    ours = ranks[0]
    _close(ours["state"], ref["state"], tol, "parameters and buffers (SyncBN's running statistics included)")
    _close(ours["momentum"], ref["momentum"], tol, "SGD's momentum")
    index: dict[int, int] = {}
    expected = []
    for _, step, _ in ours["seen"]:
        index[step] = index.get(step, -1) + 1
        expected.append(ref["micro_losses"].get((step, index[step]), float("nan")))
    _close(torch.tensor(ours["step_values"]), torch.tensor(expected), tol, "train/loss on step, each micro-batch")
    logged = ours["logged"]
    _close(torch.tensor(job.logged(logged, "train/loss_epoch")), torch.tensor(ref["epoch_losses"]), tol,
           "train/loss on epoch")  # fmt: skip
    val_loss, val_acc = zip(*ref["val"], strict=True)
    _close(torch.tensor(job.logged(logged, "val/loss")), torch.tensor(val_loss), tol, "val/loss (sync_dist)")
    _close(torch.tensor(job.logged(logged, "val/acc")), torch.tensor(val_acc), tol, "val/acc (a torchmetrics object)")
    _close(torch.tensor(job.logged(logged, "val/exact_acc")), torch.tensor(val_acc), tol,
           "val/exact_acc (SequentialEvaluation)")  # fmt: skip
    calls = [rounds for _, _, rounds in ours["rounds"]]
    assert calls == [1] * len(steps), f"gradient all-reduce rounds per optimizer step: {calls}"
    if cell["flow"] != "fit" and cell["flow"] not in job.RESUMES:
        _check_flow(cell, ours, ref, tol)


def _check_flow(cell: dict, ours: dict, ref: dict, tol: float) -> None:
    """The flow after fit evaluated the checkpoint it names (the best epoch by val/loss, the last, the
    first epoch's) as one process does."""
    flow, logged = cell["flow"], ours["flow_logged"]
    if flow == "predict-path":
        got = ours["predictions"]
        _close(got["preds"], ref["val_logits"][0], tol, "predictions of the first epoch's checkpoint, in order")
        return
    val_loss, val_acc = zip(*ref["val"], strict=True)
    epoch = min(range(len(val_loss)), key=val_loss.__getitem__) if flow == "test-best" else len(val_loss) - 1
    if flow == "test-best":
        assert ours["best"] == f"epoch={epoch}.ckpt", f"best checkpoint {ours['best']}, one process's: epoch {epoch}"
    stage = "test" if flow == "test-best" else "val"
    for name, expected in (("loss", val_loss[epoch]), ("acc", val_acc[epoch]), ("exact_acc", val_acc[epoch])):
        values = job.logged(logged, f"{stage}/{name}")
        assert len(values) == 1, f"{flow}: {stage}/{name} logged {len(values)} times"
        _close(torch.tensor(values[0]), torch.tensor(expected), tol, f"{flow}: {stage}/{name} of epoch {epoch}")


def _check_logs_kept(ours: dict) -> None:
    """metrics.csv after the flow holds every value fit and the flow logged, each once: PreemptionCheckpoint
    cuts it back only for a resume, never for an evaluation's checkpoint."""
    in_csv = sorted(
        (int(row["step"]), key) for row in ours["csv"] for key, value in row.items() if value != "" and key != "step"
    )
    logged = sorted((step, key) for step, metrics in ours["logged"] + ours["flow_logged"] for key in metrics)
    lost = [entry for entry in logged if entry not in in_csv]
    assert in_csv == logged, f"metrics.csv after the flow: {len(in_csv)} entries, {len(logged)} logged; lost {lost[:5]}"
