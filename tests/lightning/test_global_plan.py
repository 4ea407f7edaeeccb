"""Exact epochs on a global plan (``DDPPluginsStrategy(global_batch_size=G)``), against one process.

53 rows, global steps of 16 (the last has 5): 3 ranks get shares of 6/5/5 rows and, with 2
micro-batches each, micro-batches of 3/3, 3/2, 3/2 rows; in the last step rank 2 has one row and
an empty micro-batch. The model has SyncBatchNorm (through ``sync_batchnorm=True``), so gradients,
BatchNorm statistics and the row-weighted ``sync_dist`` loss are all checked against one process
that trains the same micro-batches (the union over ranks). A run stopped at step 3 resumes on
another number of ranks and ends where one process does; resumes that would train rows twice or
never are refused with one line.
"""

import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugins.core.plan import GlobalPlan, PlanBatchSampler
from ddp_plugins.core.preemption import Preempted
from ddp_plugins.lightning.allreduce_counter import AllReduceCounter
from ddp_plugins.lightning.preemption import PreemptionCheckpoint
from ddp_plugins.lightning.resume import ResumeMismatch
from ddp_plugins.lightning.strategy import DDPPluginsStrategy
from ddp_plugins.testing import run_lightning

ROWS, G, SEED, EPOCHS = 53, 16, 7, 2


def _data(rows=ROWS):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y, torch.arange(rows)


def _net(bn=True):
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(16) if bn else nn.Identity()
    return nn.Sequential(nn.Linear(8, 16), norm, nn.Tanh(), nn.Linear(16, 3)).double()


class _Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _net()
        self.seen = []  # the row ids of every micro-batch this rank trained
        self.logged = []

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self.seen.append(ids.tolist())
        loss = cross_entropy(self.net(x), y)
        self.log("train/loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.logged.append(float(self.trainer.callback_metrics["train/loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*_data()), batch_size=4, shuffle=True)  # batch_size: replaced by the plan


def _trainer(global_batch_size, accumulate=1, callbacks=(), epochs=EPOCHS, checkpoints=False):
    return pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE_HINT"]),
        strategy=DDPPluginsStrategy(backend="gloo", global_batch_size=global_batch_size),
        sync_batchnorm=True,
        accumulate_grad_batches=accumulate,
        max_epochs=epochs,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=checkpoints,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _state(model):
    return {k: v.detach().clone() for k, v in model.net.state_dict().items()}


def _run_accumulated(out_dir):
    pl.seed_everything(SEED)
    model = _Model()
    counter = AllReduceCounter(log=False)
    _trainer(G, accumulate=2, callbacks=[counter]).fit(model)
    return {"state": _state(model), "seen": model.seen, "logged": model.logged, "rounds": counter.history}


SHORT = 49  # the last step has 1 row: 2 of 3 ranks get none


def _run_short_last_step(out_dir):
    pl.seed_everything(SEED)
    model = _Model()
    model.net = _net(bn=False)  # BatchNorm cannot train on one row; plain layers can
    model.train_dataloader = lambda: DataLoader(TensorDataset(*_data(SHORT)), batch_size=4, shuffle=True)
    _trainer(G).fit(model)
    return {"state": _state(model), "seen": model.seen, "logged": model.logged}


def _run_and_checkpoint(out_dir, ckpt_dir):
    pl.seed_everything(SEED)
    model = _Model()
    every3 = ModelCheckpoint(dirpath=ckpt_dir, filename="plan-{step}", every_n_train_steps=3, save_top_k=-1)
    _trainer(G, callbacks=[every3], checkpoints=True).fit(model)
    # a plain run (Lightning's DistributedSampler, 8 rows per rank) checkpointed in the middle of its epoch
    pl.seed_everything(SEED)
    plain = _Model()
    plain.train_dataloader = lambda: DataLoader(TensorDataset(*_data()), batch_size=8, shuffle=True)
    every2 = ModelCheckpoint(dirpath=ckpt_dir, filename="plain-{step}", every_n_train_steps=2, save_top_k=-1)
    _trainer(None, callbacks=[every2], epochs=1, checkpoints=True).fit(plain)
    return {"state": _state(model), "seen": model.seen}


def _resume(out_dir, ckpt, global_batch_size):
    pl.seed_everything(SEED)
    model = _Model()
    try:
        _trainer(global_batch_size, callbacks=[ModelCheckpoint(dirpath=out_dir)], checkpoints=True).fit(
            model, ckpt_path=ckpt
        )
    except ResumeMismatch as err:
        return {"refused": str(err)}
    return {"state": _state(model), "seen": model.seen}


def _reference(accumulate, epochs=EPOCHS, rows=ROWS, bn=True):
    """One process on the plan (no world size in it): every step in `accumulate` micro-batches, each
    row's loss divided by the step's rows; returns the state and the mean loss of every micro-batch."""
    x, y, _ = _data(rows)
    net = _net(bn)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    plan = GlobalPlan(rows, G, seed=SEED, shuffle=True)
    losses = []
    for epoch in range(epochs):
        order = plan.order(epoch)
        for step in range(plan.steps_per_epoch):
            for ids in plan.micro_batches(epoch, step, 0, 1, accumulate, order):
                loss = cross_entropy(net(x[ids]), y[ids], reduction="sum")
                (loss / plan.step_size(step)).backward()
                losses.append(float(loss.detach()) / len(ids))
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, losses


def _assert_state(state, ref, where):
    for key, value in ref.items():
        torch.testing.assert_close(state[key], value, rtol=1e-9, atol=1e-11, msg=lambda m, k=key: f"{where} {k}: {m}")


def _assert_each_row_once_per_epoch(ranks, epochs, micro_per_epoch):
    for epoch in range(epochs):
        rows = sorted(
            i for r in ranks for ids in r["seen"][epoch * micro_per_epoch : (epoch + 1) * micro_per_epoch] for i in ids
        )
        assert rows == list(range(ROWS)), f"epoch {epoch}: rows padded, dropped or repeated"


def test_lightning_sets_the_epoch_of_the_plan():
    from lightning.fabric.utilities.data import _set_sampler_epoch  # what the fit loop calls every epoch

    plan = GlobalPlan(20, 6, seed=1)
    loader = DataLoader(range(20), batch_sampler=PlanBatchSampler(plan, 0, 1))
    _set_sampler_epoch(loader, 3)
    assert [i for b in loader for i in b.tolist()] == plan.order(3)


@pytest.mark.slow
def test_three_uneven_ranks_with_accumulation_and_syncbn_equal_one_process():
    ranks = run_lightning(_run_accumulated, world_size=3, timeout=240)
    ref_state, ref_losses = _reference(accumulate=2)
    micro_per_epoch = GlobalPlan(ROWS, G).steps_per_epoch * 2
    assert [len(r["seen"]) for r in ranks] == [EPOCHS * micro_per_epoch] * 3, "ranks ran different step counts"
    assert [len(ids) for ids in ranks[2]["seen"][:micro_per_epoch]] == [2, 3, 2, 3, 2, 3, 1, 0]
    _assert_each_row_once_per_epoch(ranks, EPOCHS, micro_per_epoch)
    steps = EPOCHS * GlobalPlan(ROWS, G).steps_per_epoch
    for rank, r in enumerate(ranks):
        _assert_state(r["state"], ref_state, f"rank {rank}")
        # one gradient all-reduce per optimizer step, also with an empty micro-batch in the window
        assert len(r["rounds"]) == steps and all(rounds == 1 for _, _, rounds in r["rounds"]), r["rounds"]
    # `sync_dist=True` means weighted by rows (the empty micro-batch's NaN counts for nothing)
    torch.testing.assert_close(torch.tensor(ranks[0]["logged"]), torch.tensor(ref_losses), rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_a_last_step_shorter_than_the_world_leaves_two_ranks_empty_and_equals_one_process():
    ranks = run_lightning(_run_short_last_step, world_size=3, timeout=240)
    ref_state, ref_losses = _reference(accumulate=1, rows=SHORT, bn=False)
    steps = GlobalPlan(SHORT, G).steps_per_epoch
    assert [[len(ids) for ids in r["seen"][steps - 1 :: steps]] for r in ranks] == [[1, 1], [0, 0], [0, 0]]
    for rank, r in enumerate(ranks):
        _assert_state(r["state"], ref_state, f"rank {rank}")
    assert all(torch.isfinite(v).all() for r in ranks for v in r["state"].values()), "an empty rank made NaN"
    torch.testing.assert_close(torch.tensor(ranks[0]["logged"]), torch.tensor(ref_losses), rtol=1e-9, atol=1e-11)


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("plan_ckpts")
    ranks = run_lightning(_run_and_checkpoint, str(ckpt_dir), world_size=2, timeout=240)
    return ranks, ckpt_dir


@pytest.mark.slow
def test_two_ranks_equal_one_process_and_a_resume_on_three_ranks_continues_at_the_same_row(two_rank_run):
    ranks, ckpt_dir = two_rank_run
    ref_state, _ = _reference(accumulate=1)
    for rank, r in enumerate(ranks):
        _assert_state(r["state"], ref_state, f"2 ranks, rank {rank}")
    _assert_each_row_once_per_epoch(ranks, EPOCHS, GlobalPlan(ROWS, G).steps_per_epoch)
    resumed = run_lightning(_resume, str(ckpt_dir / "plan-step=3.ckpt"), G, world_size=3, timeout=240)
    for rank, r in enumerate(resumed):
        assert "refused" not in r, r
        _assert_state(r["state"], ref_state, f"resumed on 3 ranks, rank {rank}")
    # the resumed epoch trained only its last step (5 rows), then the whole next epoch
    assert sorted(i for r in resumed for ids in r["seen"][:1] for i in ids) == sorted(
        GlobalPlan(ROWS, G, seed=SEED).step_indices(0, 3)
    )


@pytest.mark.slow
def test_a_resume_on_one_rank_continues_and_resumes_that_would_skew_the_epoch_are_refused(two_rank_run):
    _, ckpt_dir = two_rank_run
    ref_state, _ = _reference(accumulate=1)
    plan_ckpt, plain_ckpt = str(ckpt_dir / "plan-step=3.ckpt"), str(ckpt_dir / "plain-step=2.ckpt")
    (one,) = run_lightning(_resume, plan_ckpt, G, world_size=1, timeout=240)
    _assert_state(one["state"], ref_state, "resumed on 1 rank")
    (changed,) = run_lightning(_resume, plan_ckpt, 8, world_size=1, timeout=240)
    assert "global_batch_size 16 -> 8" in changed["refused"] and "\n" not in changed["refused"], changed
    (plain,) = run_lightning(_resume, plain_ckpt, None, world_size=1, timeout=240)
    assert "world_size 2 -> 1" in plain["refused"] and "global_batch_size" in plain["refused"], plain
    assert Path(plain_ckpt).exists()


# ---------------------------------------------------------------- uneven per-rank shards

SHARDS = [range(0, 38), range(38, 64), range(64, 64)]  # rows per rank: 10, 7 and 0 batches of 4


def _uneven_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g, dtype=torch.float64)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long(), torch.arange(64)


class _Shard(torch.utils.data.IterableDataset):
    """This rank's own rows, as per-rank files or a streaming dataset would give them."""

    def __iter__(self):
        x, y, ids = _uneven_data()
        for i in SHARDS[torch.distributed.get_rank()]:
            yield x[i], y[i], ids[i]


def _run_uneven(out_dir):
    pl.seed_everything(SEED)
    model = _Model()
    model.train_dataloader = lambda: DataLoader(_Shard(), batch_size=4)
    trainer = _trainer(None)
    trainer.fit(model)
    return {"state": _state(model), "seen": model.seen, "logged": model.logged, "steps": trainer.global_step}


def _reference_uneven(epochs=EPOCHS):
    x, y, _ = _uneven_data()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    batches = [[list(shard)[i : i + 4] for i in range(0, len(shard), 4)] for shard in SHARDS]
    losses = []
    for _ in range(epochs):
        for step in range(max(len(b) for b in batches)):
            rows = [i for b in batches if step < len(b) for i in b[step]]
            loss = cross_entropy(net(x[rows]), y[rows], reduction="sum")
            (loss / len(rows)).backward()
            losses.append(float(loss.detach()) / len(rows))
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, losses


@pytest.mark.slow
def test_uneven_per_rank_shards_step_together_and_equal_one_process_on_the_rows_present():
    ranks = run_lightning(_run_uneven, world_size=3, timeout=240)
    ref_state, ref_losses = _reference_uneven()
    for rank, r in enumerate(ranks):
        assert r["steps"] == EPOCHS * 10, f"rank {rank} ran {r['steps']} steps, not the longest shard's"
        assert len(r["seen"]) == EPOCHS * 10
        _assert_state(r["state"], ref_state, f"rank {rank}")
    assert [len(ids) for ids in ranks[1]["seen"][:10]] == [4] * 6 + [2, 0, 0, 0]  # exhausted: zero-row batches
    assert all(ids == [] for ids in ranks[2]["seen"]), "rank 2 has no rows: only zero-row batches"
    torch.testing.assert_close(torch.tensor(ranks[0]["logged"]), torch.tensor(ref_losses), rtol=1e-9, atol=1e-11)


class _SignalledAtStep(_Model):
    """Rank 1 gets SIGTERM inside its training step 3, as a preempted node's process would."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


class _SlowRankSignalled(_Model):
    """Rank 1 takes at least 20 ms a step and gets SIGTERM in step 31, of 100 an epoch."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            time.sleep(0.02)
            if batch_idx == 30:
                os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*_data(800)), batch_size=4)


def _fit_stopped(model, out_dir, **kwargs):
    trainer = _trainer(None, callbacks=[PreemptionCheckpoint(dirpath=out_dir, **kwargs)], checkpoints=True)
    try:
        trainer.fit(model)
    except Preempted as stop:
        return {"signum": stop.signum, "step": trainer.global_step,
                "files": sorted(p.name for p in Path(out_dir).glob("*.ckpt"))}  # fmt: skip
    return {"signum": None, "step": trainer.global_step}


def _run_stopped(out_dir):
    """The signal of step 3 on rank 1, once in the strategy's round for uneven shards, once in the
    callback's own agreement (even data) at every step, which no rank waits for; then the default
    schedule ("auto"), with a rank slower than the other."""
    from ddp_plugins.core.preemption import SignalAgreement

    rounds = []  # the stop check's own exchanges: (waited for?)
    poll, settle = SignalAgreement.poll, SignalAgreement.settle

    def counted_poll(self, signum, start=True, pace_us=0):
        if start:
            rounds.append(False)
        return poll(self, signum, start, pace_us)

    def counted_settle(self, signum):
        rounds.append(True)
        return settle(self, signum)

    SignalAgreement.poll, SignalAgreement.settle = counted_poll, counted_settle
    pl.seed_everything(SEED)
    model = _SignalledAtStep()
    model.train_dataloader = lambda: DataLoader(_Shard(), batch_size=4)
    uneven = _fit_stopped(model, f"{out_dir}/uneven") | {"rounds": list(rounds)}
    rounds.clear()
    even = _fit_stopped(_SignalledAtStep(), f"{out_dir}/even", check_every_n_steps=1) | {"rounds": list(rounds)}
    rounds.clear()
    auto = _fit_stopped(_SlowRankSignalled(), f"{out_dir}/auto") | {"rounds": list(rounds)}
    return {"uneven": uneven, "even": even, "auto": auto}


@pytest.mark.slow
def test_a_preemption_signal_stops_every_rank_at_one_step_in_the_uneven_round_or_one_step_later():
    ranks = run_lightning(_run_stopped, world_size=2, timeout=240)
    uneven, even = [r["uneven"] for r in ranks], [r["even"] for r in ranks]
    assert [r["signum"] for r in uneven + even] == [signal.SIGTERM] * 4, ranks
    assert uneven[0]["step"] == uneven[1]["step"] and 4 <= uneven[0]["step"] <= 6, ranks  # signalled in step 4
    assert uneven[0]["rounds"] == uneven[1]["rounds"] == [], "the stop check made rounds of its own"
    assert uneven[0]["files"] == [f"step-{uneven[0]['step']}-preempted.ckpt"], uneven[0]["files"]
    # even data: rank 1's flag goes out after step 4 and is read after step 5 (no epoch end between)
    assert even[0]["step"] == even[1]["step"] == 5, ranks
    assert even[0]["rounds"] == even[1]["rounds"] == [False] * 5, "a poll per step, none waited for"
    assert even[0]["files"] == ["step-5-preempted.ckpt"], even[0]["files"]
    # "auto": an exchange about every 0.5 s of the slower rank's steps (>= 20 ms: at most 25 steps
    # apart), at the same steps on both ranks; the flag of step 31 stops both at one step after it
    auto = [r["auto"] for r in ranks]
    stop = auto[0]["step"]
    assert auto[1]["step"] == stop and 31 < stop <= 31 + 25 + 1 and auto[0]["signum"] == signal.SIGTERM, auto
    assert auto[0]["files"] == [f"step-{stop}-preempted.ckpt"], auto[0]["files"]
    assert auto[0]["rounds"] == auto[1]["rounds"] and 3 <= len(auto[0]["rounds"]) < stop / 2, auto


class _EpochLogged(_Model):
    """Also logs the loss as an epoch mean over ranks (an empty micro-batch's mean loss is NaN)."""

    def __init__(self):
        super().__init__()
        self.epoch_means = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/epoch_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        self.log("train/worst", loss, sync_dist=True, on_step=False, on_epoch=True, reduce_fx="max")
        return loss

    def on_train_epoch_end(self):
        metrics = self.trainer.callback_metrics
        self.epoch_means.append((float(metrics["train/epoch_loss"]), float(metrics["train/worst"])))


def _run_uneven_accumulated(out_dir, ckpt_path=None):
    pl.seed_everything(SEED)
    model = _EpochLogged()
    model.train_dataloader = lambda: DataLoader(_Shard(), batch_size=4)
    every3 = ModelCheckpoint(dirpath=out_dir, filename="uneven-{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = _trainer(None, accumulate=2, callbacks=[every3], checkpoints=True)
    trainer.fit(model, ckpt_path=ckpt_path)
    saved = Path(out_dir) / "uneven-step=3.ckpt"
    return {
        "state": _state(model),
        "seen": model.seen,
        "epochs": model.epoch_means,
        "steps": trainer.global_step,
        "checkpoint": saved.read_bytes() if saved.exists() and ckpt_path is None else None,
    }


def _reference_uneven_windows(k=2, epochs=EPOCHS):
    """One process: window w of K micro-batches; micro-batch m is the union of the ranks' batch
    w*K+m; every row's loss is divided by the rows of the whole window (the optimizer step)."""
    x, y, _ = _uneven_data()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    batches = [[list(shard)[i : i + 4] for i in range(0, len(shard), 4)] for shard in SHARDS]
    longest = max(len(b) for b in batches)
    epoch_means = []
    for _ in range(epochs):
        total, rows_seen = 0.0, 0
        for first in range(0, longest, k):
            micro = [[i for b in batches if m < len(b) for i in b[m]] for m in range(first, min(first + k, longest))]
            step_rows = sum(len(rows) for rows in micro)
            for rows in micro:
                loss = cross_entropy(net(x[rows]), y[rows], reduction="sum")
                (loss / step_rows).backward()
                total, rows_seen = total + float(loss.detach()), rows_seen + len(rows)
            opt.step()
            opt.zero_grad()
        epoch_means.append(total / rows_seen)
    return {k_: v.detach().clone() for k_, v in net.state_dict().items()}, epoch_means


@pytest.mark.slow
def test_uneven_shards_with_accumulation_equal_one_process_per_window_and_resume_inside_an_epoch(tmp_path):
    ranks = run_lightning(_run_uneven_accumulated, world_size=3, timeout=240)
    ref_state, ref_epoch_means = _reference_uneven_windows()
    for rank, r in enumerate(ranks):
        assert r["steps"] == EPOCHS * 5, f"rank {rank}: {r['steps']} optimizer steps, not 5 windows of 2 per epoch"
        _assert_state(r["state"], ref_state, f"rank {rank}")
        # the epoch means are over rows, and the empty micro-batches' NaN counts for nothing
        means = [mean for mean, _ in r["epochs"]]
        torch.testing.assert_close(torch.tensor(means), torch.tensor(ref_epoch_means), rtol=1e-9, atol=1e-11)
        assert all(torch.isfinite(torch.tensor(worst)) for _, worst in r["epochs"]), r["epochs"]
    assert ranks[0]["epochs"] == ranks[2]["epochs"], "rank 2 (no rows at all) must log the same epoch values"
    # resumed from step 3 (6 micro-batches into epoch 0): each rank skips its own first 6 batches
    checkpoint = tmp_path / "uneven-step=3.ckpt"
    checkpoint.write_bytes(ranks[0]["checkpoint"])
    resumed = run_lightning(_run_uneven_accumulated, str(checkpoint), world_size=3, timeout=240)
    for rank, r in enumerate(resumed):
        _assert_state(r["state"], ref_state, f"resumed, rank {rank}")
        assert [len(ids) for ids in r["seen"][:4]] == [[4, 4, 4, 2], [2, 0, 0, 0], [0, 0, 0, 0]][rank], r["seen"][:4]


def _refused_before_launch(global_batch_size, accumulate):
    model = _Model()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPPluginsStrategy(backend="gloo", global_batch_size=global_batch_size, start_method="spawn"),
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(ValueError) as caught:
        trainer.fit(model)
    return caught.value


def test_a_global_batch_smaller_than_ranks_times_accumulation_is_refused_before_any_rank_starts():
    error = _refused_before_launch(3, 2)  # a spawned rank's error would come back as ProcessRaisedException
    assert type(error).__name__ == "ArgumentValueError" and "\n" not in str(error), repr(error)
    assert "`global_batch_size` should be at least world size x accumulate_grad_batches (2 x 2 = 4)" in str(error)


class _Watched(pl.LightningModule):
    """Records, in each micro-batch, whether ``self.log`` is still the class's method, and its rows and loss."""

    def __init__(self):
        super().__init__()
        self.net, self.steps, self.callbacks_seen = _net(bn=False), [], []

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = cross_entropy(self.net(x), y)
        self.steps.append(("log" in vars(self), len(x), float(loss.detach())))
        self.log("train/mean", loss, sync_dist=True, on_step=False, on_epoch=True)
        self.log("train/worst", loss, sync_dist=True, on_step=False, on_epoch=True, reduce_fx="max")
        self.callbacks_seen.append(list(self.trainer.callbacks))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the same loss each epoch

    def train_dataloader(self):
        return DataLoader(TensorDataset(*_data(5)), batch_size=4)


@pytest.mark.usefixtures("clean_process_state")
def test_an_empty_micro_batch_counts_for_nothing_and_module_log_stays_the_class_method():
    model = _Watched()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=DDPPluginsStrategy(backend="gloo", global_batch_size=4),
        accumulate_grad_batches=2, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    before = list(trainer.callbacks)
    trainer.fit(model)
    assert [rows for _, rows, _ in model.steps] == [2, 2, 1, 0], "steps of 4 and 1 rows, 2 micro-batches each"
    assert not any(replaced for replaced, _, _ in model.steps), "module.log was replaced on the instance"
    assert "log" not in vars(model)
    assert all(seen == before for seen in model.callbacks_seen) and trainer.callbacks == before
    rows = [(n, loss) for _, n, loss in model.steps if n]
    expected = sum(n * loss for n, loss in rows) / sum(n for n, _ in rows)
    metrics = trainer.callback_metrics
    torch.testing.assert_close(float(metrics["train/mean"]), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(float(metrics["train/worst"]), max(loss for _, loss in rows), rtol=1e-6, atol=0)
