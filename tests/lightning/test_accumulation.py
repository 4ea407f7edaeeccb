"""Accumulation-aware no_sync and the all-reduce counter (Lightning adapters), against single-process references."""

import re

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.func import functional_call
from torch.nn.functional import binary_cross_entropy_with_logits as bce
from torch.nn.functional import mse_loss
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_plugins.lightning.accumulation import AccumulationNoSync
from ddp_plugins.lightning.allreduce_counter import AllReduceCounter
from ddp_plugins.testing import run_lightning
from tests.core.test_comm_hooks import _user_hook
from tests.helpers.loggers import RecordingLogger

BATCH = 4  # per rank
BATCHES_PER_EPOCH = 10  # per rank; not a multiple of K=4, so each epoch ends on a short window
WORLD = 2


# ---------------------------------------------------------------- data and models


def _regression_data():
    g = torch.Generator().manual_seed(0)
    n = WORLD * BATCH * BATCHES_PER_EPOCH
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return x, y


def _gan_data():
    g = torch.Generator().manual_seed(1)
    n = WORLD * BATCH * BATCHES_PER_EPOCH
    real = torch.randn(n, 2, generator=g, dtype=torch.float64) * 0.5 + 1.0
    noise = torch.randn(n, 2, generator=g, dtype=torch.float64)
    return real, noise


def _global_batches(tensors):
    """What one process sees: global batch t is the union of every rank's batch t.

    The non-shuffling DistributedSampler of `_loader` gives rank r the samples r, r + 2, ...; so rank
    batches t of both ranks together are the samples [2 * BATCH * t, 2 * BATCH * (t + 1)).
    """
    step = WORLD * BATCH
    return [tuple(t[i * step : (i + 1) * step] for t in tensors) for i in range(BATCHES_PER_EPOCH)]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def _gan_nets():
    torch.manual_seed(1)
    gen = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    disc = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    return gen, disc


def _frozen(module, x):
    """``module(x)`` with its parameters detached: no gradient reaches them, ``requires_grad`` untouched."""
    return functional_call(module, {n: p.detach() for n, p in module.named_parameters()}, (x,))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class _ManualRegression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = _mlp()
        self.records = []

    def training_step(self, batch, batch_idx):
        acc = AccumulationNoSync.of(self.trainer)
        x, y = batch
        loss = mse_loss(self.net(x), y) / acc.accumulate_grad_batches
        self.manual_backward(loss)
        grads = [p.grad.detach().clone() for p in self.net.parameters()]
        self.records.append((acc.is_boundary, grads, all(p.requires_grad for p in self.parameters())))
        if acc.is_boundary:
            opt = self.optimizers()
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return _sgd(self.net.parameters())

    def train_dataloader(self):
        return _loader(self, _regression_data())


class _AutoRegression(_ManualRegression):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        return mse_loss(self.net(x), y)


class _Gan(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.gen, self.disc = _gan_nets()
        self.requires_grad_seen = []

    def training_step(self, batch, batch_idx):
        acc = AccumulationNoSync.of(self.trainer)
        k = acc.accumulate_grad_batches
        opt_g, opt_d = self.optimizers()
        real, noise = batch
        fake = self.gen(noise)
        ones, zeros = torch.ones_like(real[:, :1]), torch.zeros_like(real[:, :1])
        d_loss = bce(self.disc(real), ones) + bce(self.disc(fake.detach()), zeros)
        self.manual_backward(d_loss / k)
        if acc.is_boundary:
            opt_d.step()
            opt_d.zero_grad()
        g_loss = bce(_frozen(self.disc, fake), ones)
        self.manual_backward(g_loss / k)
        if acc.is_boundary:
            opt_g.step()
            opt_g.zero_grad()
        self.requires_grad_seen.append(all(p.requires_grad for p in self.parameters()))

    def configure_optimizers(self):
        return _sgd(self.gen.parameters()), _sgd(self.disc.parameters())

    def train_dataloader(self):
        return _loader(self, _gan_data())


def _loader(module, tensors):
    """Rank r gets samples r, r + 2, ... in order (Lightning's own sampler would shuffle)."""
    dataset = TensorDataset(*tensors)
    world, rank = module.trainer.world_size, module.trainer.global_rank
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, world, rank, shuffle=False))


def _trainer(callbacks, epochs, strategy="ddp", devices=WORLD, logger=False, **kwargs):
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        callbacks=callbacks,
        enable_progress_bar=False,
        logger=logger,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **kwargs,
    )


# ---------------------------------------------------------------- single-process references


def _boundaries(k):
    return [(i + 1) % k == 0 or i + 1 == BATCHES_PER_EPOCH for i in range(BATCHES_PER_EPOCH)]


def _reference_regression(k, epochs):
    """One process, global batches, the same accumulation: returns the params and per-batch grads."""
    net = _mlp()
    opt = _sgd(net.parameters())
    grads = []
    for _ in range(epochs):
        for (x, y), boundary in zip(_global_batches(_regression_data()), _boundaries(k), strict=True):
            (mse_loss(net(x), y) / k).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
            if boundary:
                opt.step()
                opt.zero_grad()
    return [p.detach() for p in net.parameters()], grads


def _reference_gan(schedule):
    gen, disc = _gan_nets()
    opt_g, opt_d = _sgd(gen.parameters()), _sgd(disc.parameters())
    for k in schedule:
        for (real, noise), boundary in zip(_global_batches(_gan_data()), _boundaries(k), strict=True):
            ones, zeros = torch.ones_like(real[:, :1]), torch.zeros_like(real[:, :1])
            fake = gen(noise)
            ((bce(disc(real), ones) + bce(disc(fake.detach()), zeros)) / k).backward()
            if boundary:
                opt_d.step()
                opt_d.zero_grad()
            (bce(_frozen(disc, fake), ones) / k).backward()
            if boundary:
                opt_g.step()
                opt_g.zero_grad()
    return [p.detach() for p in [*gen.parameters(), *disc.parameters()]]


def _assert_params_close(got, expected, what):
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(
            g, e, atol=1e-6, rtol=0, msg=lambda m: f"{what}: params differ from one process\n{m}"
        )


# ---------------------------------------------------------------- argument checks (no processes)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        *[(bad, ValueError) for bad in (0, -2, {}, {0: 0}, {-1: 2}, {0: 2, "1": 3})],
        *[(bad, TypeError) for bad in (1.5, True, "4", None)],
    ],
)
def test_bad_accumulate_grad_batches_is_one_clear_error(bad, error):
    message = rf"`accumulate_grad_batches` should be a positive int or .* got {re.escape(repr(bad))}\.$"
    with pytest.raises(error, match=message):
        AccumulationNoSync(accumulate_grad_batches=bad)


def test_schedule_follows_gradient_accumulation_scheduler_rule():
    acc = AccumulationNoSync({2: 4, 5: 8})
    lightning = GradientAccumulationScheduler({2: 4, 5: 8})
    for epoch in range(8):
        assert acc.scheduling_for(epoch) == lightning.get_accumulate_grad_batches(epoch), epoch
    assert AccumulationNoSync(3).scheduling == {0: 3}


def test_counter_checks_its_arguments():
    with pytest.raises(TypeError, match="`log` should be True or False, got 'yes'"):
        AllReduceCounter(log="yes")
    with pytest.raises(ValueError, match="`prefix` should be a non-empty str, got ''"):
        AllReduceCounter(prefix="")


# ---------------------------------------------------------------- single-process Trainer: boundaries and clashes


class _RecordBoundaries(_ManualRegression):
    def __init__(self):
        super().__init__()
        self.seen = []

    def training_step(self, batch, batch_idx):
        acc = AccumulationNoSync.of(self.trainer)
        self.seen.append((self.current_epoch, acc.accumulate_grad_batches, acc.is_boundary))
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):  # one process: 10 batches per epoch as each rank sees them
        return DataLoader(TensorDataset(*(t[::2] for t in _regression_data())), batch_size=BATCH)


def test_boundaries_follow_schedule_and_epoch_end_in_manual_optimization():
    model = _RecordBoundaries()
    _trainer([AccumulationNoSync({0: 4, 1: 3})], epochs=2, strategy="auto", devices=1).fit(model)
    expected = [(0, 4, b) for b in _boundaries(4)] + [(1, 3, b) for b in _boundaries(3)]
    assert model.seen == expected


@pytest.mark.parametrize(("callback_k", "trainer_k"), [(4, 1), (1, 4)])
def test_boundaries_agree_with_lightning_in_automatic_optimization(callback_k, trainer_k):
    class Auto(_AutoRegression):
        def training_step(self, batch, batch_idx):
            acc = AccumulationNoSync.of(self.trainer)
            self.records.append((acc.accumulate_grad_batches, acc.is_boundary, self.trainer.accumulate_grad_batches))
            return super().training_step(batch, batch_idx)

        def train_dataloader(self):
            return _RecordBoundaries.train_dataloader(self)

    model = Auto()
    trainer = _trainer(
        [AccumulationNoSync(callback_k)], epochs=1, strategy="auto", devices=1, accumulate_grad_batches=trainer_k
    )
    trainer.fit(model)
    assert model.records == [(4, b, 4) for b in _boundaries(4)]
    assert trainer.global_step == sum(_boundaries(4)), "Lightning stepped once per window"
    assert trainer.accumulate_grad_batches == trainer_k, "the Trainer's own K is left as it was given"


K_TWICE = (
    r"`accumulate_grad_batches` should be 1 here when `Trainer\(accumulate_grad_batches\)` sets K \(set it in one"
    r" place\), got 4 with Trainer\(accumulate_grad_batches=2\)\."
)


def test_k_set_twice_is_a_clear_error():
    with pytest.raises(ValueError, match=K_TWICE):
        _trainer([AccumulationNoSync(4)], 1, strategy="auto", devices=1, accumulate_grad_batches=2).fit(
            _AutoRegression()
        )
    with pytest.raises(ValueError, match="both set the accumulation factor"):
        callbacks = [AccumulationNoSync(4), GradientAccumulationScheduler({0: 2})]
        _trainer(callbacks, 1, strategy="auto", devices=1).fit(_AutoRegression())


def test_check_trainer_finds_the_clashes_without_fitting():
    """The checks `setup` makes, callable on a Trainer that has not started (the app's up-front check)."""
    model = _AutoRegression()
    trainer = _trainer([AccumulationNoSync(4)], 1, strategy="auto", devices=1, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=K_TWICE):
        AccumulationNoSync(4).check_trainer(trainer, model)
    callbacks = [AccumulationNoSync(4), GradientAccumulationScheduler({0: 2})]
    with pytest.raises(ValueError, match="both set the accumulation factor"):
        callbacks[0].check_trainer(_trainer(callbacks, 1, strategy="auto", devices=1), model)
    AccumulationNoSync(4).check_trainer(_trainer([], 1, strategy="auto", devices=1), model)  # no clash
    AccumulationNoSync(1).check_trainer(trainer, model)  # K=1 leaves the Trainer's K in charge


def test_of_without_the_callback_names_what_to_add():
    trainer = _trainer([], 1, strategy="auto", devices=1)
    expected = r"has no `AccumulationNoSync`.*Add `AccumulationNoSync\(accumulate_grad_batches=K\)`"
    with pytest.raises(ValueError, match=expected):
        AccumulationNoSync.of(trainer)


# ---------------------------------------------------------------- Trainer-level runs on 2 ranks


class _LogsBatchIndex(pl.Callback):
    """A metric through Lightning's own logging, to compare the counter's logger steps with."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.log("batch_idx", float(batch_idx), on_step=True, on_epoch=False)


def _run_manual(out_dir, k, epochs):
    counter, logger = AllReduceCounter(), RecordingLogger()
    model = _ManualRegression()
    trainer = _trainer([AccumulationNoSync(k), counter, _LogsBatchIndex()], epochs, logger=logger, log_every_n_steps=1)
    trainer.fit(model)
    return {
        "records": model.records,
        "params": [p.detach().clone() for p in model.net.parameters()],
        "history": counter.history,
        "calls": counter.calls,
        "rounds": counter.rounds,
        "bytes": counter.bytes,
        "logged_rounds_total": logger.latest()["comm/allreduce_rounds_total"],
        "counter_steps": [step for step, metrics in logger.logged if "comm/allreduce_rounds" in metrics],
        "lightning_steps": {step: m["batch_idx"] for step, m in logger.logged if "batch_idx" in m},
    }


@pytest.mark.slow
def test_manual_no_sync_on_2_ranks_equals_one_process():
    k, epochs = 4, 2
    ranks = run_lightning(_run_manual, k, epochs, timeout=240)
    ref_params, ref_grads = _reference_regression(k, epochs)
    numel = sum(p.numel() for p in ref_params)
    r0, r1 = ranks
    assert len(r0["records"]) == epochs * BATCHES_PER_EPOCH
    assert [b for b, _, _ in r0["records"]] == _boundaries(k) * epochs
    for i, ((boundary, g0, rg0), (_, g1, rg1)) in enumerate(zip(r0["records"], r1["records"], strict=True)):
        assert rg0 and rg1, "requires_grad was changed"
        same = all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
        if boundary:
            assert same, f"micro-step {i} (boundary): gradients not in sync when they should be"
            for a, e in zip(g0, ref_grads[i], strict=True):
                torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-8, msg=f"boundary {i}: not the global gradient")
        else:
            assert not same, f"micro-step {i} (non-boundary): gradients in sync when they should not be"
    for rank, r in enumerate(ranks):
        _assert_params_close(r["params"], ref_params, f"rank {rank}")
        steps = epochs * sum(_boundaries(k))  # 3 per epoch: windows 4, 4, 2
        assert r["rounds"] == steps and r["calls"] == steps, "one all-reduce per optimizer step, not per micro-step"
        assert r["history"] == [(1, numel * 8, 1)] * steps
        assert r["bytes"] == steps * numel * 8
        assert r["logged_rounds_total"] == steps
        # written at every optimizer step (log_every_n_steps=1), at the step Lightning logs that batch's metrics
        boundaries = [i for i, boundary in enumerate(_boundaries(k) * epochs) if boundary]
        assert [r["lightning_steps"][step] for step in r["counter_steps"]] == [
            i % BATCHES_PER_EPOCH for i in boundaries
        ]


def _run_automatic(out_dir, k):
    out = {}
    # 1) Lightning's own accumulation, plus a user's communication hook that the counter wraps
    for name, trainer_k, callbacks in (
        ("trainer", k, []),
        ("callback", 1, [AccumulationNoSync(k)]),
    ):
        _user_hook.seen = 0
        counter = AllReduceCounter()
        model = _AutoRegression()
        strategy = DDPStrategy(ddp_comm_hook=_user_hook)
        trainer = _trainer([*callbacks, counter], 1, strategy=strategy, accumulate_grad_batches=trainer_k)
        trainer.fit(model)
        out[name] = {
            "params": [p.detach().clone() for p in model.net.parameters()],
            "history": counter.history,
            "global_step": trainer.global_step,
            "user_seen": _user_hook.seen,
            "hook_untouched": strategy._ddp_comm_hook is _user_hook,
        }
    return out


@pytest.mark.slow
def test_automatic_accumulation_counts_one_round_per_optimizer_step():
    k = 4
    ranks = run_lightning(_run_automatic, k, timeout=240)
    ref_params, _ = _reference_regression(k, 1)
    numel = sum(p.numel() for p in ref_params)
    steps = sum(_boundaries(k))
    for rank, out in enumerate(ranks):
        for name in ("trainer", "callback"):
            r = out[name]
            assert r["global_step"] == steps
            assert r["history"] == [(1, numel * 8, 1)] * steps, f"rank {rank} {name}: not one round per step"
            assert r["user_seen"] == steps, "the user's hook was not kept under the counter"
            assert r["hook_untouched"], "the strategy's hook was rewritten"
            _assert_params_close(r["params"], ref_params, f"rank {rank} {name}")


def _run_gan(out_dir, schedule):
    counter = AllReduceCounter()
    model = _Gan()
    strategy = DDPStrategy(find_unused_parameters=True)  # each GAN loss leaves one net out of its graph
    trainer = _trainer([AccumulationNoSync(dict(enumerate(schedule))), counter], len(schedule), strategy=strategy)
    trainer.fit(model)
    return {
        "params": [p.detach().clone() for p in [*model.gen.parameters(), *model.disc.parameters()]],
        "history": counter.history,
        "requires_grad": model.requires_grad_seen,
    }


@pytest.mark.slow
def test_two_optimizer_gan_with_schedule_equals_one_process():
    schedule = [2, 3]  # epoch 0: K=2; epoch 1: K=3 (windows 3, 3, 3, 1)
    ranks = run_lightning(_run_gan, schedule, timeout=240)
    ref = _reference_gan(schedule)
    boundary_batches = sum(sum(_boundaries(k)) for k in schedule)
    for rank, r in enumerate(ranks):
        assert all(r["requires_grad"]), "requires_grad was toggled"
        _assert_params_close(r["params"], ref, f"rank {rank}")
        # two optimizer steps per boundary batch, each after its own synchronized backward
        assert len(r["history"]) == 2 * boundary_batches
        assert all(calls == 1 and rounds == 1 for calls, _, rounds in r["history"]), r["history"]
