"""The promise matrix: each promise of the pack, the axes it must hold over, and which cells run.

A cell is one value per axis. Each cell runs a short job on real gloo ranks and compares it with
the one-process reference (``tests/matrix/job.py``) at the tolerance of its precision. ``make test``
runs :func:`pairwise` (every pair of values of two axes in at least one cell), ``make test-matrix``
runs :func:`product` (every cell) and writes ``docs/promise_matrix.md``.

Not every combination is a cell (:func:`not_a_cell` says why, and the table lists those reasons), and
some cells are refused by the pack in one line before training (:func:`refusal`): such a cell proves
the refusal (the job fails with exactly that line) instead of the promises. None is skipped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

# What each cell compares with the one-process reference (each a check of tests/matrix/job.py).
PROMISES = {
    "parameters": "parameters, buffers and the optimizer's state equal one process on the global batch",
    "rows": "each row trained once per epoch; on a plan, the same rows at every global step on any N",
    "logged": "every logged value equals one process: `self.log(sync_dist=True)` on step and on epoch"
    " (training and validation), a torchmetrics metric object, SequentialEvaluation's exact metric",
    "syncbn": "SyncBN's running statistics equal one process's BatchNorm on the global micro-batch",
    "allreduce": "one gradient all-reduce round per optimizer step (none inside an accumulation);"
    " the reproducible mode sums outside DDP's reducer (its bits are compared instead)",
    "flows": "a Lightning flow after fit (with PreemptionCheckpoint and a CSVLogger) evaluates the checkpoint"
    " it names as one process does, and every row logged before it is still in metrics.csv; a fit resumed"
    " from the last checkpoint of its first epoch, or stopped by a SIGTERM in its middle or on its last step"
    " and resumed from PreemptionCheckpoint's checkpoint (in its middle also on another number of ranks),"
    " ends as the uninterrupted run (every promise above)",
}

# Promises proven outside the matrix, at points (each names its tests); not yet an axis of the matrix.
OUTSIDE = {
    "resume on another N in the app": "the app's run stopped on N ranks resumes on another N (the flow axis"
    " resumes a library cell on another N, `resume-n`): tests/app/test_exact_epochs.py,"
    " tests/app/test_reproducible.py",
    "fit twice": "a second fit of the same Trainer with PreemptionCheckpoint keeps every row logged:"
    " tests/lightning/test_preemption_evaluation.py; fit then test with the app's configs:"
    " tests/lightning/test_weights_only.py",
}

AXES: dict[str, tuple] = {
    "entry": ("library", "app"),  # a plain Trainer with the strategy; or python -m ddp_plugins.train
    "ranks": (1, 2, 3, 4),
    # per-rank: the default mode (no global_batch_size, b rows per rank); a global batch G divisible by
    # the ranks, not divisible, or with a last step shorter than the number of ranks
    "batch": ("per-rank", "divisible", "not-divisible", "short-last"),
    "accumulation": (1, 2, 3),
    "syncbn": ("on", "off"),  # off: a model without BatchNorm (with BatchNorm per rank there is no one process)
    "precision": ("32-true", "64-true", "bf16-mixed"),
    # plan: the app's datamodule, or a DataLoader(shuffle=False) (Lightning shuffles any training loader
    # under DDP, and the plan does as Lightning); shuffle: a user's DataLoader(shuffle=True) with no
    # generator; sampler: a DataLoader with a sampler of the user's own
    "loader": ("plan", "shuffle", "sampler"),
    "reproducible": ("off", "on"),
    # what runs after fit: nothing; test(ckpt_path="best"); validate(ckpt_path="last"); predict with the
    # path of the first epoch's checkpoint (SequentialEvaluation's ordered predictions); or the fit stops
    # after its first epoch and a new Trainer resumes from the last checkpoint (fit(ckpt_path=...)); or it
    # stops in the middle of the first epoch (after global step 2), or on its last step, and a new Trainer
    # resumes from PreemptionCheckpoint's checkpoint; or stops in the middle and resumes on another N
    "flow": ("fit", "test-best", "validate-last", "predict-path", "resume", "resume-mid", "resume-end", "resume-n"),
}

# The comparison's tolerance per precision (relative and absolute, torch.testing.assert_close):
# float64: the sums of N ranks are added in another order, rounding at 1e-16 per operation;
# float32: 2 epochs of SGD with momentum on a smooth (tanh) net keep the ~1e-7 rounding of a
# reduction in another order below 1e-5; bf16-mixed: the matmuls round to 8 bits (4e-3) per rank's
# share, and a share's sum rounds before the all-reduce adds the ranks in float32.
# The reproducible mode is compared bit for bit with the same cell on another number of ranks.
VIRTUAL_SHARDS = 4  # the reproducible mode's, in every cell: up to 4 ranks
TOLERANCE = {"64-true": 1e-10, "32-true": 1e-5, "bf16-mixed": 3e-2}


def not_a_cell(cell: dict) -> str | None:
    """Why a combination of values is not a cell (``None``: it is one)."""
    planned = cell["batch"] != "per-rank"
    if cell["entry"] == "app" and cell["loader"] != "plan":
        return "the app's loader is its datamodule's, on the plan: a user's loader is a library cell"
    if cell["entry"] == "app" and cell["flow"] != "fit":
        return "the app runs fit: a flow after fit is a library cell"
    if cell["entry"] == "app" and not planned:
        return "the app's default-mode rows depend on N (Lightning's DistributedSampler): a library cell replays them"
    if cell["loader"] == "plan" and not planned:
        return "a plan needs a global batch"
    if cell["reproducible"] == "on" and not planned:
        return "the reproducible mode needs a global batch"
    if cell["ranks"] == 1 and cell["batch"] in ("not-divisible", "short-last"):
        return "every global batch is divisible by 1 rank, and no step is shorter than 1 rank"
    short = cell["batch"] == "short-last" and cell["ranks"] - 1 < 2 * cell["accumulation"]
    if cell["entry"] == "library" and cell["syncbn"] == "on" and short:
        return "a last step of N - 1 rows in K micro-batches has one of 1 row: no BatchNorm1d trains on it"
    return None


def refusal(cell: dict) -> str | None:
    """The start of the one line with which the pack refuses the cell before training (``None``: it runs)."""
    # in the pack's order: the Trainer's settings first, then the training loader. The app refuses before
    # any rank starts, in its `error: <key> got <value>, allowed: ...` form (a part of it here)
    app = cell["entry"] == "app"
    if cell["reproducible"] == "on" and cell["accumulation"] != 1:  # the mode cuts each step into shards itself
        if app:
            return "error: trainer.accumulate_grad_batches got"
        return "`accumulate_grad_batches` should be 1 with reproducible=True"
    if cell["loader"] == "sampler" and cell["batch"] != "per-rank":
        return "`global_batch_size` should be used with a DataLoader whose sampler is Lightning's DistributedSampler"
    if cell["reproducible"] == "on" and cell["batch"] == "short-last":  # a last step of N - 1 <= 3 rows
        if app:
            return f"allowed: one that leaves every step at least virtual_shards={VIRTUAL_SHARDS} rows"
        return f"`global_batch_size` should be one that leaves every step at least virtual_shards={VIRTUAL_SHARDS} rows"
    if cell["flow"] == "resume-n" and cell["batch"] == "per-rank":  # the resume, on another N
        return "resume: the checkpoint stopped in the middle of an epoch"
    return None


def cells() -> Iterator[dict]:
    """Every cell, in the order of the axes."""
    for values in itertools.product(*AXES.values()):
        cell = dict(zip(AXES, values, strict=True))
        if not_a_cell(cell) is None:
            yield cell


def product() -> list[dict]:
    """``make test-matrix``: every cell."""
    return list(cells())


def pairwise() -> list[dict]:
    """``make test``: cells that run and cover every pair of values of two axes that a running cell has,
    then the first cell of each refusal (a refused cell proves the refusal, not the promises).

    Greedy (as in AETG): repeatedly take the cell that covers the most pairs not yet covered, the
    first in :func:`cells`'s order on a tie, so the subset is the same on every run.
    """
    running = [cell for cell in cells() if refusal(cell) is None]
    names = list(AXES)

    def pairs(cell: dict) -> set[tuple]:
        return {(a, cell[a], b, cell[b]) for a, b in itertools.combinations(names, 2)}

    left = set().union(*(pairs(cell) for cell in running))
    chosen: list[dict] = []
    while left:
        best = max(running, key=lambda cell: len(pairs(cell) & left))
        chosen.append(best)
        left -= pairs(best)
    refusals: dict[str, dict] = {}
    for cell in cells():
        reason = refusal(cell)
        if reason is not None:
            refusals.setdefault(reason, cell)
    return chosen + list(refusals.values())


def cell_id(cell: dict) -> str:
    """A cell's name in test ids and the table: its values in the order of the axes."""
    return "-".join(str(cell[axis]) for axis in AXES)
