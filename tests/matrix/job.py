"""One cell of the promise matrix (tests/matrix/table.py): the job on its ranks, and the one-process reference.

The library entry: a plain ``Trainer`` with ``DDPPluginsStrategy`` on the cell's ranks (forked from the
warm rank server by ``run_lightning``), the cell's global batch, accumulation, precision, loader and
mode. The model is an MLP (tanh: smooth, so float32 noise stays float32 noise) with a BatchNorm1d
converted to SyncBN, or without BatchNorm. Every rank records the row ids of every micro-batch and the
global step it belongs to; rank 0's logger records every logged value.

The reference replays those global micro-batches (the union over the ranks of micro-batch ``m`` of
each step) in one process, in plain torch: each step's gradient is the sum of its rows' losses over
its rows, BatchNorm normalizes each global micro-batch, validation runs over the real rows. So the
cell checks what the ranks did against one process on the same global batches; a plan cell checks
too that those batches are the plan's, the same on any N (:func:`planned_rows`). A cell's flow runs
after fit, with ModelCheckpoint, PreemptionCheckpoint and a CSVLogger: ``test(ckpt_path="best")``,
``validate(ckpt_path="last")`` or ``predict`` with the first epoch's checkpoint path; the reference
evaluates that epoch's state, and metrics.csv must still hold every row logged. The flow ``resume``
fits the first epoch, then resumes a new Trainer from its last checkpoint; in ``resume-mid`` rank 0
gets a real SIGTERM once global step :data:`MID_STEP` is done, in the middle of the first epoch,
PreemptionCheckpoint stops every rank at the next step with its checkpoint, and a new Trainer resumes
from it; ``resume-end`` does the same with the signal one step before the first epoch's last, so the
stop lands on that last step (its checkpoint written after the epoch's validation and end);
``resume-n`` stops as ``resume-mid`` does and resumes on another number of ranks (:func:`other_ranks`),
where the plan allows it (a per-rank batch is refused in one line: its rows depend on N).
What the ranks did past that checkpoint is dropped from the records, as the resume drops it (and
PreemptionCheckpoint cuts metrics.csv back to it): the whole run is checked.
"""

from __future__ import annotations

import csv
import os
import signal
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, Sampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from ddp_plugins.core import Preempted
from ddp_plugins.core.plan import GlobalPlan
from ddp_plugins.lightning.allreduce_counter import AllReduceCounter
from ddp_plugins.lightning.csv_logger import ResumableCSVLogger
from ddp_plugins.lightning.preemption import PreemptionCheckpoint
from ddp_plugins.lightning.sequential_evaluation import SequentialEvaluation
from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from tests.matrix.table import VIRTUAL_SHARDS

SEED, EPOCHS, VAL_ROWS, PER_RANK = 7, 2, 21, 4
# resume-mid's signal, after step 1: the stop lands after step 2, in the middle of every cell's epoch of 3 or 4
# steps; resume-end's comes after the first epoch's last step but one
MID_STEP = 1
RESUMES = ("resume", "resume-mid", "resume-end", "resume-n")
DTYPES = {"32-true": torch.float32, "64-true": torch.float64, "bf16-mixed": torch.float32}


def sizes(cell: dict) -> tuple[int, int | None]:
    """The cell's training rows and global batch (``None``: the default mode, ``PER_RANK`` rows a rank)."""
    n, k = cell["ranks"], cell["accumulation"]
    return {
        "per-rank": (n * PER_RANK * k * 3, None),  # 3 whole steps an epoch, on every N
        "divisible": (48, 12),  # 4 steps of 12 rows
        "not-divisible": (52, 13),  # 4 steps of 13 rows: shares differ by a row
        "short-last": (36 + n - 1, 12),  # 3 steps of 12 and one of N - 1 rows: a rank gets none
    }[cell["batch"]]


def data(rows: int, seed: int) -> TensorDataset:
    """Rows of 8 features, 3 classes, and each row's id."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y, torch.arange(rows))


def net(syncbn: str) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(16) if syncbn == "on" else nn.Identity()
    return nn.Sequential(nn.Linear(8, 16), norm, nn.Tanh(), nn.Linear(16, 3))


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class _OwnSampler(Sampler):
    """A sampler of the user's own: the rows in a fixed shuffled order (its own generator)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(torch.randperm(self.rows, generator=torch.Generator().manual_seed(11)).tolist())

    def __len__(self) -> int:
        return self.rows


class _Model(pl.LightningModule):
    def __init__(self, cell: dict) -> None:
        super().__init__()
        self.cell = cell
        self.net = net(cell["syncbn"])
        self.acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.seen: list[tuple[int, int, list[int]]] = []  # (epoch, global step, row ids) per micro-batch
        self.step_values: list[float] = []  # train/loss as logged on step, after each micro-batch
        self.value_steps: list[int] = []  # the global step of each of those

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self.seen.append((self.current_epoch, self.trainer.global_step, ids.tolist()))
        loss = cross_entropy(self.net(x), y)
        self.log("train/loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_values.append(float(self.trainer.callback_metrics["train/loss_step"]))
        self.value_steps.append(self.seen[-1][1])

    def validation_step(self, batch, batch_idx, stage="val"):
        x, y, _ = batch
        logits = self.net(x)
        self.log(f"{stage}/loss", cross_entropy(logits, y), sync_dist=True)
        self.acc(logits, y)
        self.log(f"{stage}/acc", self.acc)
        return {"preds": logits.float(), "target": y}

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx, "test")

    def predict_step(self, batch, batch_idx):
        x, y, _ = batch
        return {"preds": self.net(x).float(), "target": y}

    def configure_optimizers(self):
        return optimizer(self.parameters())

    def train_dataloader(self):
        rows, planned = sizes(self.cell)
        dataset, batch = data(rows, 1), PER_RANK if planned is None else 4  # a plan replaces batch_size
        if self.cell["loader"] == "sampler":
            return DataLoader(dataset, batch_size=batch, sampler=_OwnSampler(rows))
        return DataLoader(dataset, batch_size=batch, shuffle=self.cell["loader"] == "shuffle")

    def val_dataloader(self):
        return DataLoader(data(VAL_ROWS, 2), batch_size=5)


class _Memory(Logger):
    """Every value logged, with its step (rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    name, version = "memory", 0

    @property
    def experiment(self) -> None:
        return None

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((int(step or 0), {k: float(v) for k, v in metrics.items()}))


class _SigtermAt(pl.Callback):
    """A real SIGTERM to rank 0 once global step ``step`` is done (once per Trainer); ``None``: the first
    epoch's last step but one."""

    def __init__(self, step: int | None) -> None:
        self.step, self.sent = step, False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.estimated_stepping_batches // EPOCHS - 1 if self.step is None else self.step
        if trainer.global_step == step and trainer.is_global_zero and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def trainer(
    cell: dict, loggers: list[Logger], callbacks: list, ckpt_dir: str | None = None, epochs: int = EPOCHS
) -> pl.Trainer:
    """The cell's Trainer; with ``ckpt_dir``, a checkpoint of every epoch (the best by ``val/loss``, and
    the last) and PreemptionCheckpoint's own (its stop agreed at every step), as a flow after fit loads them."""
    _, planned = sizes(cell)
    strategy = DDPPluginsStrategy(
        backend="gloo", global_batch_size=planned, reproducible=cell["reproducible"] == "on",
        virtual_shards=VIRTUAL_SHARDS,
    )  # fmt: skip
    if ckpt_dir is not None:
        every = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", monitor="val/loss", save_top_k=-1, save_last=True)
        callbacks = [
            *callbacks,
            every,
            PreemptionCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, check_every_n_steps=1),
        ]
    return pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE_HINT"]), strategy=strategy,
        sync_batchnorm=cell["syncbn"] == "on", accumulate_grad_batches=cell["accumulation"],
        precision=cell["precision"], max_epochs=epochs, callbacks=callbacks, logger=loggers, log_every_n_steps=1,
        enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip


def run(out_dir: str, cell: dict, keep: str | None = None, resume_from: str | None = None) -> dict[str, Any]:
    """The cell's job on this rank: what it trained, logged and counted (a refusal's one line instead),
    and what its flow after fit evaluated, logged and left in metrics.csv.

    ``resume-n`` runs in two calls, with its checkpoints and metrics.csv in ``keep`` (they outlive each
    call's folder): without ``resume_from``, the fit stopped by the signal, what it kept and its checkpoint
    (``"resume_from"``); with it, on :func:`other_ranks`, the resume to the end."""
    pl.seed_everything(SEED)
    model, memory = _Model(cell), _Memory()
    counter = AllReduceCounter(log=False)
    exact = SequentialEvaluation(metrics={"exact_acc": MulticlassAccuracy(num_classes=3, average="micro")})
    flow, folder = cell["flow"], keep or out_dir
    ckpt_dir = os.path.join(folder, "checkpoints")
    # a resume in a new process (resume-n) continues metrics.csv with the pack's CSV logger: Lightning's
    # starts the file again; in one process (the other flows) Lightning's own keeps its rows
    csv_logger = ResumableCSVLogger if flow == "resume-n" else CSVLogger
    loggers: list[Logger] = [memory] if flow == "fit" else [memory, csv_logger(folder, name="csv", version="")]
    rounds: list = []
    try:
        if flow == "resume-n" and resume_from is None:  # stopped after step MID_STEP, resumed by the next call
            path = _stopped(cell, model, loggers, counter, [exact, _SigtermAt(MID_STEP)], ckpt_dir, memory)
            return {"seen": model.seen, "step_values": model.step_values, "logged": list(memory.rows),
                    "rounds": counter.history, "resume_from": path}  # fmt: skip
        if flow == "resume":  # the first epoch, then a new Trainer resumes from its last checkpoint to the end
            trainer(cell, loggers, [counter, exact], ckpt_dir, epochs=1).fit(model)
            resume_from = os.path.join(ckpt_dir, "last.ckpt")
        elif flow in ("resume-mid", "resume-end"):  # stopped by a signal; a new Trainer resumes from its checkpoint
            signal_at = _SigtermAt(MID_STEP if flow == "resume-mid" else None)
            resume_from = _stopped(cell, model, loggers, counter, [exact, signal_at], ckpt_dir, memory)
        if resume_from is not None:
            rounds, counter = counter.history, AllReduceCounter(log=False)
        fitted = trainer(cell, loggers, [counter, exact], None if flow == "fit" else ckpt_dir)
        fitted.fit(model, ckpt_path=resume_from)
    except (ValueError, TypeError) as refused:
        return {"refused": str(refused).splitlines()[0]}
    state = {k: v.detach().clone() for k, v in model.net.state_dict().items()}
    momentum = [model.trainer.optimizers[0].state[p]["momentum_buffer"].clone() for p in model.net.parameters()]
    result = {"state": state, "momentum": momentum, "seen": model.seen, "step_values": model.step_values,
              "logged": list(memory.rows), "rounds": rounds + counter.history, "flow_logged": []}  # fmt: skip
    if flow != "fit" and flow not in RESUMES:
        result.update(_flow(fitted, model, exact, memory, flow, ckpt_dir))
    if flow != "fit" and fitted.is_global_zero:  # what metrics.csv holds once the flow ended
        with open(os.path.join(folder, "csv", "metrics.csv"), newline="") as file:
            result["csv"] = list(csv.DictReader(file))
    return result


def _stopped(
    cell: dict,
    model: _Model,
    loggers: list[Logger],
    counter: AllReduceCounter,
    callbacks: list,
    ckpt_dir: str,
    memory: _Memory,
) -> str:
    """Fit until PreemptionCheckpoint stops every rank on the signal; keep only what the checkpoint holds
    (the rows, losses, logged values and all-reduce rounds of the steps before it); its path."""
    stopped = trainer(cell, loggers, [counter, *callbacks], ckpt_dir)
    try:
        stopped.fit(model)
    except Preempted as stop:
        assert stop.checkpoint is not None, "PreemptionCheckpoint stopped without a checkpoint"
        path = stop.checkpoint
        step = int(os.path.basename(path).split("-")[1])
    else:
        raise AssertionError(f"{cell['flow']}: the fit was not stopped")
    per_epoch = stopped.estimated_stepping_batches // EPOCHS
    where = step == per_epoch if cell["flow"] == "resume-end" else 0 < step < per_epoch
    assert where, f"{os.path.basename(path)}: not where {cell['flow']} stops ({per_epoch} steps an epoch)"
    model.seen = [seen for seen in model.seen if seen[1] < step]
    kept = [i for i, at in enumerate(model.value_steps) if at < step]
    model.step_values, model.value_steps = [model.step_values[i] for i in kept], [model.value_steps[i] for i in kept]
    memory.rows[:] = [(at, metrics) for at, metrics in memory.rows if at < step]
    counter.history[:] = counter.history[:step]
    return path


def _flow(
    fitted: pl.Trainer, model: _Model, exact: SequentialEvaluation, memory: _Memory, flow: str, ckpt_dir: str
) -> dict[str, Any]:
    """Run the cell's flow after fit: what it logged and predicted, and the best checkpoint's name."""
    before = len(memory.rows)
    loader = model.val_dataloader()
    if flow == "test-best":
        fitted.test(model, dataloaders=loader, ckpt_path="best", verbose=False)
    elif flow == "validate-last":
        fitted.validate(model, dataloaders=loader, ckpt_path="last", verbose=False)
    else:
        fitted.predict(model, dataloaders=loader, ckpt_path=os.path.join(ckpt_dir, "epoch=0.ckpt"))
    best = fitted.checkpoint_callback.best_model_path if fitted.checkpoint_callback is not None else ""
    predictions = exact.results.get("predict") if flow == "predict-path" else None
    return {"flow_logged": memory.rows[before:], "best": os.path.basename(best), "predictions": predictions}


def other_ranks(n: int) -> int:
    """The number of ranks ``resume-n`` resumes on: the next of 1 to 4 (4 ranks resume on 1)."""
    return n % 4 + 1


def global_steps(ranks: list[dict]) -> list[list[list[int]]]:
    """The global micro-batches of every optimizer step: the union over the ranks of micro-batch ``m``
    (with ``resume-n``, the ranks before the stop too: rank 0's ``before``)."""
    steps: dict[int, list[list[int]]] = {}
    for rank in [*ranks, *ranks[0].get("before", [])]:
        index: dict[int, int] = {}
        for _, step, ids in rank["seen"]:
            m = index[step] = index.get(step, -1) + 1
            micro = steps.setdefault(step, [])
            micro += [[] for _ in range(m + 1 - len(micro))]
            micro[m] += ids
    return [steps[s] for s in sorted(steps)]


def planned_rows(cell: dict, epoch: int) -> list[list[int]]:
    """The rows of each step of ``epoch`` on one process of the plan (any N gives the same)."""
    rows, planned = sizes(cell)
    plan = GlobalPlan(rows, planned, seed=SEED, shuffle=True)  # Lightning shuffles every training loader under DDP
    order = plan.order(epoch)
    return [
        sorted(i for ids in plan.micro_batches(epoch, step, 0, 1, cell["accumulation"], order) for i in ids)
        for step in range(plan.steps_per_epoch)
    ]


def reference(cell: dict, steps: list[list[list[int]]], steps_per_epoch: int) -> dict[str, Any]:
    """One process on the same global micro-batches: state, momentum and every value the job logs."""
    dtype = DTYPES[cell["precision"]]
    model = net(cell["syncbn"]).to(dtype)
    opt = optimizer(model.parameters())
    rows, _ = sizes(cell)
    x, y, _ = data(rows, 1).tensors
    vx, vy, _ = data(VAL_ROWS, 2).tensors
    x, vx = x.to(dtype), vx.to(dtype)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cell["precision"] == "bf16-mixed")
    micro_losses: dict[tuple[int, int], float] = {}  # by (global step, micro-batch)
    epoch_losses, val, val_logits = [], [], []
    epoch_sum = epoch_rows = 0.0
    for index, micro_batches in enumerate(steps):
        model.train()
        step_rows = sum(len(ids) for ids in micro_batches)
        for m, ids in enumerate(micro_batches):
            if not ids:
                continue
            with autocast:
                loss = cross_entropy(model(x[ids]), y[ids], reduction="sum")
            (loss / step_rows).backward()
            micro_losses[index, m] = float(loss.detach()) / len(ids)
            epoch_sum, epoch_rows = epoch_sum + float(loss.detach()), epoch_rows + len(ids)
        opt.step()
        opt.zero_grad()
        if (index + 1) % steps_per_epoch == 0:
            epoch_losses.append(epoch_sum / epoch_rows)
            epoch_sum = epoch_rows = 0.0
            model.eval()
            with torch.no_grad(), autocast:
                logits = model(vx)
                loss = cross_entropy(logits, vy)
            val.append((float(loss), float((logits.argmax(1) == vy).float().mean())))  # accuracy: torchmetrics' float32
            val_logits.append(logits.float())
    momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    return {"state": model.state_dict(), "momentum": momentum, "micro_losses": micro_losses,
            "epoch_losses": epoch_losses, "val": val, "val_logits": val_logits}  # fmt: skip


def logged(rows: list[tuple[int, dict[str, float]]], key: str) -> list[float]:
    return [metrics[key] for _, metrics in rows if key in metrics]
