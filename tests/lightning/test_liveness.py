"""Every stall the liveness room names, on real gloo ranks of a Lightning fit: the ranks are forked
from the rank server (``ddp_plugins.testing``), each writes its own log; limits of 2 s (named) and
5 s (ended) stand for the defaults' 30 s and 300 s."""

from __future__ import annotations

import ctypes
import os
import pickle
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from ddp_plugins.testing import _RankServer, free_port

pytestmark = pytest.mark.slow

NAME, END = 2.0, 5.0
STEP = 6  # the global step at which a case acts
# where a case "<fault> <phase>" acts (a plain case acts in its training step, before the forward)
_PHASES = ("validation", "epoch-end", "checkpoint", "rank-zero-callback")


class _Net(pl.LightningModule):
    def __init__(self, case: str, rank: int) -> None:
        super().__init__()
        self.case, self.rank = case, rank
        self.layer = torch.nn.Linear(8, 2)
        if case.endswith("syncbn"):  # the other ranks wait in SyncBN's all-reduce inside the forward
            self.layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        self.pair = None

    def prepare_data(self) -> None:  # a hook Lightning runs between barriers of its own at start-up
        if self.case == "slow prepare_data":  # rank 0 (local rank 0 prepares) downloads; the others wait
            time.sleep(3 * NAME)

    def setup(self, stage: str) -> None:
        if self.case == "slow setup":  # rank 0 works past the naming limit, then every rank rendezvouses
            if self.global_rank == 0:
                time.sleep(NAME + 2)
            dist.new_group()
        if self.case == "collective":
            self.pair = dist.new_group([0, 1])  # every rank makes it; only rank 1 ever calls into it

    def training_step(self, batch, batch_idx):
        elsewhere = " " in self.case and self.case.split(" ", 1)[1] in _PHASES  # acts in another phase
        if not elsewhere and self.global_step == STEP and (self.global_rank == self.rank or self.rank == -1):
            self._act()
        elif self.global_step > STEP and self.case.split(" ")[0] in ("pause", "gil", "work"):
            time.sleep(0.1)  # steps the room sees pass (at 0.33 s intervals) before the fit ends
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def _at(self, phase: str) -> None:
        """Act in ``phase`` (the case's second word) at global step STEP, on the case's rank."""
        if self.case.endswith(f" {phase}") and self.global_step == STEP and self.global_rank == self.rank:
            self._act()

    def validation_step(self, batch, batch_idx):
        if batch_idx == 1:
            self._at("validation")
        x, y = batch
        self.log("val/loss", torch.nn.functional.cross_entropy(self.layer(x), y), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self._at("epoch-end")  # the others go on to the epoch end's reduction of val/loss

    def on_save_checkpoint(self, checkpoint) -> None:
        self._at("checkpoint")  # the others go on to the barrier after the save

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._at("rank-zero-callback")  # a rank-zero-only callback's work, before the next step

    def val_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(24, 8), torch.randint(0, 2, (24,)))
        return torch.utils.data.DataLoader(data, batch_size=4)

    def _act(self) -> None:
        case = self.case.split(" ")[0] if self.case.split(" ", 1)[-1] in _PHASES else self.case
        if case in ("sigstop", "sigkill"):
            os.kill(os.getpid(), getattr(signal, case.upper()))
        elif case in ("hang", "timeout", "hang syncbn"):
            time.sleep(600)  # inside its step (before its forward), neither raising nor dying
        elif case == "collective":
            dist.barrier(group=self.pair)  # a collective that rank 0 never enters
        elif case in ("long", "pause"):
            time.sleep(NAME + 2)  # every rank ("long"), or one rank, longer than the naming limit
        elif case == "work":
            time.sleep(END + 3)  # one rank's legitimate work, past the end limit: a compile, a cold cache
        elif case == "gil":
            ctypes.PyDLL(None).sleep(int(NAME + 2))  # a C call that keeps the GIL: no thread of it runs
        elif case == "raise":
            raise ValueError(f"boom in training_step of rank {self.global_rank}")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(160, 8), torch.randint(0, 2, (160,)))
        return torch.utils.data.DataLoader(data, batch_size=4)


def _fit(out_dir: str, case: str, rank: int, world_size: int, timeout: float) -> int:
    if case == "slow import" and os.environ["RANK"] == "1":
        time.sleep(3 * NAME)  # rank 1 reaches the rendezvous late (issue 53: a start-up slowed by 40 s under load)
    name = NAME if timeout > NAME + END else 10 * timeout  # a short collective timeout fails first
    strategy = DDPPluginsStrategy(
        backend="gloo", timeout=timeout, stall_name_after=name, stall_end_after=max(END, name),
        stall_end_running=case.split(" ")[0] in ("hang", "collective"),  # the operator's key: ended too
    )  # fmt: skip
    phase = case.split(" ", 1)[-1]
    saves = [pl.callbacks.ModelCheckpoint(dirpath=out_dir, every_n_train_steps=STEP)] if phase == "checkpoint" else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEP + 10, default_root_dir=out_dir,
        enable_progress_bar=False, logger=False, enable_checkpointing=bool(saves), callbacks=saves,
        enable_model_summary=False, sync_batchnorm=case.endswith("syncbn"), num_sanity_val_steps=0,
        **({"val_check_interval": STEP, "limit_val_batches": 3} if phase in ("validation", "epoch-end") else
           {"limit_val_batches": 0}),
    )  # fmt: skip
    trainer.fit(_Net(case, rank))
    return trainer.global_step


def _run(case: str, rank: int, world_size: int = 2, timeout: float = 1800.0):
    """Exit codes and logs by rank, the seconds the job took, and the run's folder's files."""
    with tempfile.TemporaryDirectory(prefix="ddp_plugins_liveness_") as out_dir:
        (Path(out_dir) / "args.pkl").write_bytes(pickle.dumps((case, rank, world_size, timeout)))
        request = {
            "target": f"{__name__}:_fit", "out_dir": out_dir, "world_size": world_size,
            "env": {"MASTER_PORT": str(free_port())}, "cwd": os.getcwd(), "path": sys.path, "timeout": 90,
        }  # fmt: skip
        start = time.monotonic()
        codes = _RankServer.get().run(request, 90)
        took = time.monotonic() - start
        logs = {r: (Path(out_dir) / f"rank{r}.log").read_text(errors="replace") for r in range(world_size)}
        files = sorted(str(p.relative_to(out_dir)) for p in Path(out_dir).rglob("*") if p.is_file())
    return codes, logs, took, files


_TORCH_STORE_WARNING = re.compile(
    r"\[rank\d+\]:\[W.* TCPStore\.cpp:\d+\] |Exception raised from (recv|send)Bytes |frame #\d+: "
    r"|<omitting python frames>"
)


def _exits(result, codes):
    """A stuck rank whose room still runs leaves with the others (1), or is killed first (-9): ``(1, -9)``."""
    return result.keys() == codes.keys() and all(
        result[r] in (c if isinstance(c, tuple) else (c,)) for r, c in codes.items()
    )


def _lines(logs):
    """Every rank's non-blank log lines but Lightning's start-up chatter (its rank lines, device info, tips,
    Python warnings ``file.py:N: message``): what the stall made the ranks print."""
    chatter = (
        r"Initializing distributed|^-+$|distributed_backend=|All distributed processes|GPU avail|TPU|Tip:|stopped: `max"
        r"|^SyncBatchNorm: converted"
    )
    noise = re.compile(chatter + r"|^/\S+\.py:\d+: ")
    lines = [(r, line) for r, text in logs.items() for line in text.splitlines()]
    return [(r, line) for r, line in lines if line.strip() and not noise.search(line)]


@pytest.mark.parametrize(
    ("case", "rank", "world_size", "how", "reporter", "codes"),
    [
        ("sigstop", 0, 2, "the job's store (hosted there) does not answer", 1, {0: -9, 1: 1}),
        ("sigstop", 1, 2, "its process is stopped (SIGSTOP or a debugger)", 0, {0: 1, 1: -9}),
        ("sigstop", 2, 3, "its process is stopped (SIGSTOP or a debugger)", 0, {0: 1, 1: 1, 2: -9}),
        ("hang", 1, 2, "it stopped progressing while the other ranks wait for it", 0, {0: 1, 1: (1, -9)}),
        ("collective", 1, 3, "it stopped progressing while the other ranks wait for it", 0, {0: 1, 1: (1, -9), 2: 1}),
        # before its forward, while the others wait in SyncBN's all-reduce at the same mark (a1c30de: never named)
        ("hang syncbn", 1, 2, "it stopped progressing while the other ranks wait for it", 0, {0: 1, 1: (1, -9)}),
        ("hang syncbn", 0, 3, "it stopped progressing while the other ranks wait for it", 1, {0: (1, -9), 1: 1, 2: 1}),
    ],
)
def test_a_stall_is_named_in_one_line_then_the_job_ends(case, rank, world_size, how, reporter, codes):
    result, logs, took, files = _run(case, rank, world_size)
    assert _exits(result, codes), f"exit codes {result}\n{logs}"
    lines = _lines(logs)
    assert len(lines) == 2, f"one line naming it, one ending the job, nothing else:\n{lines}"
    (said_by, named), (_, ended) = lines
    assert said_by == reporter and named.startswith(f"error: rank {rank} (PID "), lines
    assert f"a training step (global step {STEP})" in named or case != "hang syncbn", named  # where it is
    assert how in named and re.search(r"the job ends in [\d.]+ s", named), named
    assert ended.startswith("error: ending every rank;"), ended
    if reporter == 0:  # rank 0 saw every rank's record and stack
        assert "stall.txt" in files, files
        assert re.search(r"checkpoints/step-\d+-stalled\.ckpt", ended) and any("stalled.ckpt" in f for f in files)


@pytest.mark.parametrize(
    ("case", "rank", "how", "codes"),
    [
        ("sigkill", 1, "its process is gone (killed or exited)", {0: 1, 1: -9}),
        ("sigkill", 0, "its process is gone (killed or exited)", {0: -9, 1: 1}),
        ("timeout", 1, "it stopped progressing while the other ranks wait for it", {0: 1, 1: (1, -9)}),
    ],
)
def test_a_failed_collective_names_the_rank_that_caused_it_and_ends_the_job_at_once(case, rank, how, codes):
    """A killed rank, or a collective timeout (3 s, before the 2 s + 5 s limits would)."""
    result, logs, took, _ = _run(case, rank, timeout=3.0 if case == "timeout" else 1800.0)
    assert _exits(result, codes), f"exit codes {result}\n{logs}"
    lines = _lines(logs)
    if (case, rank) == ("sigkill", 0):
        # the store's host killed outright: a store call of rank 1's room that was in flight makes torch's
        # C++ client print its warning (docs/design.md); nothing else of it, and never a Python traceback
        lines = [(r, line) for r, line in lines if not _TORCH_STORE_WARNING.match(line)]
    assert len(lines) == 2, f"one line naming it, one ending the job, nothing else:\n{lines}"
    named, ended = lines[0][1], lines[1][1]
    assert named.startswith(f"error: rank {rank} (PID ") and how in named, named
    # what the backend said, where the collective failed first; a killed process may be seen in /proc first
    said = "; a collective failed waiting for it (RuntimeError: " in named
    assert said or case == "sigkill" and "; the job ends now" in named, named
    assert ended.startswith("error: ending every rank"), ended


@pytest.mark.parametrize("case", ["long", "slow setup", "slow prepare_data", "slow import"])
def test_a_long_step_on_every_rank_and_a_slow_start_are_left_alone(case):
    """Every rank in one long step; rank 0 working past the naming limit in `setup` before every rank
    makes a group (a1c30de: the rendezvous deadlocked on the room's store client, or a rank was named), or
    in `prepare_data` while the others wait at Lightning's barrier; rank 1 slow to reach the rendezvous."""
    result, logs, _, _ = _run(case, -1)
    assert result == {0: 0, 1: 0}, logs
    assert _lines(logs) == [], "nothing is named when every rank is in the same long step or rendezvous"


@pytest.mark.parametrize(
    ("case", "how"),
    [
        ("pause", "it stopped progressing while the other ranks wait for it"),
        ("gil", "its process runs but publishes nothing (a C call holding Python's GIL)"),  # not 'stopped'
        ("work", "it stopped progressing while the other ranks wait for it"),  # past the end limit
    ],
)
def test_a_rank_that_pauses_past_the_naming_limit_is_named_and_the_run_finishes(case, how):
    """By default a rank whose process runs is named, never ended (a1c30de ended "work" at the end limit)."""
    result, logs, _, _ = _run(case, 1)
    assert result == {0: 0, 1: 0}, logs
    lines = [line for _, line in _lines(logs)]
    assert len(lines) == 2, lines
    assert lines[0].startswith("error: rank 1 (PID ") and how in lines[0], lines
    assert "the job goes on (a rank whose process runs is not ended)" in lines[0], lines
    assert lines[1] == "ddp_plugins: ranks [1] progress again", lines


def test_a_rank_that_raises_shows_its_own_traceback_and_the_other_names_it():
    result, logs, _, _ = _run("raise", 1)
    assert result[1] == 1 and result[0] == 1, logs
    assert "ValueError: boom in training_step of rank 1" in logs[1], logs[1]
    rank0 = [line for r, line in _lines(logs) if r == 0]
    assert rank0[0].startswith("error: rank 1 (PID ") and "raised ValueError: boom in training_step" in rank0[0], rank0
    assert "it raised an error (its own traceback says where)" in rank0[0], rank0
    assert "Traceback" not in logs[0], logs[0]


_BEHIND = "it stopped progressing while the other ranks wait for it"


@pytest.mark.parametrize(
    ("case", "rank", "world_size", "phase", "how", "codes"),
    [
        ("hang validation", 1, 2, "a validation step", _BEHIND, {0: 1, 1: (1, -9)}),
        ("sigstop validation", 1, 3, "a validation step", "its process is stopped", {0: 1, 1: -9, 2: 1}),
        ("hang epoch-end", 1, 2, "a validation step", _BEHIND, {0: 1, 1: (1, -9)}),
        ("hang checkpoint", 1, 2, "", _BEHIND, {0: 1, 1: (1, -9)}),
    ],
)  # fmt: skip
def test_a_stall_in_validation_at_the_epoch_end_or_in_a_checkpoint_save_is_named_and_ended(
    case, rank, world_size, phase, how, codes
):
    """The fault matrix's phases past the training step: a validation step, the epoch end's reduction
    of what validation logged (rank 1 still in its hook), a checkpoint's save (the others at its barrier)."""
    result, logs, _, _ = _run(case, rank, world_size)
    assert _exits(result, codes), f"exit codes {result}\n{logs}"
    lines = _lines(logs)
    assert len(lines) == 2, f"one line naming it, one ending the job, nothing else:\n{lines}"
    named, ended = lines[0][1], lines[1][1]
    assert named.startswith(f"error: rank {rank} (PID ") and how in named, named
    assert phase in named, f"the phase should be {phase!r}: {named}"  # the rank's own, or where the others are
    assert ended.startswith("error: ending every rank"), ended


@pytest.mark.parametrize("case", ["work checkpoint", "work rank-zero-callback"])
def test_rank_0s_slow_save_or_rank_zero_only_work_is_named_once_and_the_run_finishes(case):
    """A slow disk under rank 0's checkpoint, or a rank-zero-only callback's work, past the end limit:
    legitimate, so named once ("the job goes on") and the fit ends with every rank's exit 0."""
    result, logs, _, _ = _run(case, 0)
    assert result == {0: 0, 1: 0}, logs
    lines = [line for _, line in _lines(logs)]
    assert len(lines) == 2, lines
    assert lines[0].startswith("error: rank 0 (PID ") and "the job goes on" in lines[0], lines
    assert lines[1] == "ddp_plugins: ranks [0] progress again", lines
