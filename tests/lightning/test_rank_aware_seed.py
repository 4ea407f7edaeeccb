"""RankAwareSeed (the Lightning callback): identical init, per-rank streams, worker streams, exact resume.

The seeding functions it builds on are tested in tests/core/test_seeding.py.
"""

from __future__ import annotations

import io
import os
import random
import re
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.seed import isolate_rng

from ddp_plugins.core.checkpoints import gather_per_rank
from ddp_plugins.core.seeding import seed_everything_rank_aware
from ddp_plugins.lightning.rank_aware_seed import RankAwareSeed
from tests.helpers import REPO_ROOT
from tests.helpers.rng import BAD_SEEDS, Isolated, assert_all_differ, draw, same

CONF_DIR = REPO_ROOT / "conf"


def _fake_trainer(rank: int, world_size: int) -> SimpleNamespace:
    return SimpleNamespace(global_rank=rank, world_size=world_size)


def _resume(callback: RankAwareSeed, state: dict | None, rank: int, world_size: int, step: int) -> None:
    """The calls the Trainer makes when it resumes from a checkpoint saved at ``step``."""
    trainer = _fake_trainer(rank, world_size)
    callback.setup(trainer, None, "fit")
    checkpoint = {"global_step": step, "callbacks": {} if state is None else {callback.state_key: state}}
    callback.on_load_checkpoint(trainer, None, checkpoint)
    if state is not None:
        callback.load_state_dict(state)
    callback.on_fit_start(trainer, None)


# ---------------------------------------------------------------------------------------------
# 2 gloo ranks (dist_pool)


def _test_checkpoint_round_trip(rank, world_size):
    dist.barrier()
    with Isolated():
        callback = RankAwareSeed(5)
        seed_everything_rank_aware(5)
        torch.rand(3), np.random.rand(2), random.random(), np.random.randn()  # advance, cache a gaussian
        # what DDPPluginsStrategy.save_checkpoint does with it: every rank's part, gathered
        state = gather_per_rank({"callbacks": {"seed": callback.state_dict()}})["callbacks"]["seed"]
        expected = draw()
        seed_everything_rank_aware(99)  # scramble
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)  # the Trainer's default under torch >= 2.6
        _resume(RankAwareSeed(5), loaded, rank, world_size, step=10)
        return state["world_size"], len(state["per_rank"]), expected, draw()


def test_checkpoint_holds_every_rank_and_each_rank_restores_its_own(dist_pool):
    results = dist_pool.run(_test_checkpoint_round_trip)
    for rank, (world_size, n_states, expected, restored) in enumerate(results):
        assert (world_size, n_states) == (2, 2), f"rank {rank}: states of {n_states} ranks, expected 2"
        assert same(expected, restored), f"rank {rank} did not continue its own stream after restore"
    assert_all_differ(results[0][2], results[1][2], "after restoring rank 0 and rank 1")


# ---------------------------------------------------------------------------------------------
# one process


def test_resume_with_another_world_size_warns_and_starts_fresh_streams(isolated):
    seed_everything_rank_aware(11)
    state = RankAwareSeed(11).state_dict()  # one process, not gathered: the states of 1 rank
    assert state["world_size"] == 1 and sorted(state["per_rank"]) == ["numpy", "python", "torch", "torch.cuda"]
    saved_stream = draw()

    fresh, resumed = [], []
    for rank in range(2):
        seed_everything_rank_aware(11, rank=rank)
        fresh.append(draw())
        with pytest.warns(UserWarning, match="random states for 1 ranks, this run has 2"):
            _resume(RankAwareSeed(11), state, rank, 2, step=6)
        resumed.append(draw())
    assert_all_differ(resumed[0], resumed[1], "on two ranks after a world-size change")
    for rank in range(2):
        assert_all_differ(resumed[rank], fresh[rank], f"on rank {rank}: the resumed run replays the first epoch")
        assert_all_differ(resumed[rank], saved_stream, f"on rank {rank} and the checkpoint's only rank")


def test_resume_from_checkpoint_without_states_does_not_replay_first_streams(isolated):
    seed_everything_rank_aware(8, rank=1)
    fresh = draw()
    with pytest.warns(UserWarning, match="no `RankAwareSeed` random states"):
        _resume(RankAwareSeed(8), None, 1, 2, step=4)
    assert_all_differ(draw(), fresh, "after resuming at step 4 and at the start")


def test_restore_after_fit_start_as_fsdp_and_deepspeed_do(isolated):
    # strategies with `restore_checkpoint_after_setup` load callback states after on_fit_start
    seed_everything_rank_aware(4, rank=1)
    np.random.rand(3)
    state = RankAwareSeed(4).state_dict()
    expected = draw()
    callback, trainer = RankAwareSeed(4), _fake_trainer(0, 1)
    callback.setup(trainer, None, "fit")
    callback.on_fit_start(trainer, None)
    callback.on_load_checkpoint(trainer, None, {"global_step": 3, "callbacks": {"RankAwareSeed": state}})
    callback.load_state_dict(state)
    assert same(draw(), expected), "a state loaded after on_fit_start was not applied"


def test_warns_when_lightning_replays_epoch_zero_order_on_resume(isolated):
    import warnings

    data = torch.arange(8)

    def resumed_trainer(num_workers: int, shuffle: bool) -> SimpleNamespace:
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0, shuffle=shuffle)
        loader = torch.utils.data.DataLoader(data, sampler=sampler, num_workers=num_workers)
        return SimpleNamespace(global_rank=0, world_size=1, current_epoch=1, train_dataloader=loader)

    callback = RankAwareSeed(2)
    callback.on_load_checkpoint(None, None, {"global_step": 4})
    with pytest.warns(UserWarning, match="Lightning issue 21938"):
        callback.on_train_start(resumed_trainer(num_workers=2, shuffle=True), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.on_train_start(resumed_trainer(num_workers=0, shuffle=True), None)  # lazy: order is right
        callback.on_train_start(resumed_trainer(num_workers=2, shuffle=False), None)  # order has no epoch
        RankAwareSeed(2).on_train_start(resumed_trainer(num_workers=2, shuffle=True), None)  # a fresh run


def test_callback_setup_sets_the_deterministic_flags(isolated):
    torch.use_deterministic_algorithms(False)
    RankAwareSeed(1, deterministic=True).setup(_fake_trainer(0, 1), None, "fit")
    assert torch.are_deterministic_algorithms_enabled(), "the callback's setup did not set the flags"


@pytest.mark.parametrize(("seed", "error"), BAD_SEEDS)
def test_seed_out_of_range_is_a_clear_error(seed, error):
    message = rf"^`seed` should be an integer in \[0, 4294967295\], got {re.escape(repr(seed))}\.$"
    with pytest.raises(error, match=message):
        RankAwareSeed(seed)


def test_bad_flags_are_clear_errors():
    with pytest.raises(TypeError, match=r"^`deterministic` should be True or False, got 1\.$"):
        RankAwareSeed(1, deterministic=1)
    with pytest.raises(TypeError, match=r"^`workers` should be True or False, got 'yes'\.$"):
        RankAwareSeed(1, workers="yes")


def test_seed_boundaries_are_accepted():
    assert RankAwareSeed(0).seed == 0 and RankAwareSeed(2**32 - 1).seed == 2**32 - 1
    assert RankAwareSeed(np.int64(7)).seed == 7


def test_hydra_config_interpolates_app_seed_and_deterministic(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    (tmp_path / "app.yaml").write_text(
        "defaults:\n  - callbacks: rank_aware_seed\n  - _self_\n"
        f"hydra:\n  searchpath:\n    - file://{CONF_DIR}\n"
        "seed: 42\ndeterministic: false\n"
    )
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
            callback = instantiate(compose("app").callbacks.rank_aware_seed)
            assert isinstance(callback, RankAwareSeed)
            assert (callback.seed, callback.workers, callback.deterministic) == (42, True, False)
            callback = instantiate(compose("app", overrides=["seed=7", "deterministic=true"]).callbacks.rank_aware_seed)
            assert (callback.seed, callback.deterministic) == (7, True)
            with pytest.raises(InstantiationException, match="`seed` should be an integer"):
                instantiate(compose("app", overrides=["seed=-3"]).callbacks.rank_aware_seed)
    finally:
        GlobalHydra.instance().clear()


# ---------------------------------------------------------------------------------------------
# real Lightning DDP runs: streams, identical initialization, exact resume

SEED = 1234


class _AugmentedData(torch.utils.data.Dataset):
    """Fixed points plus random noise (the augmentation); each item also reports its worker's draws."""

    def __init__(self, n: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        probe = torch.tensor([torch.rand(()).item(), np.random.rand(), random.random()], dtype=torch.float64)
        info = torch.utils.data.get_worker_info()
        x = self.x[i] + 0.3 * torch.randn(8) * (1 + np.random.rand()) + random.random()
        return x, self.y[i], probe, torch.tensor(info.id if info is not None else -1)


def _make_module():
    import lightning.pytorch as pl

    class DropoutNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1)
            )
            self.probes: list = []
            self.predictions: list = []

        def setup(self, stage):
            self.setup_draw = torch.rand(4)  # after RankAwareSeed.setup: the base seed on every rank

        def on_train_start(self):
            self.start_params = _flat(self)
            with isolate_rng():  # peek at the rank's stream without consuming it
                self.start_draw = torch.rand(4)

        def training_step(self, batch, batch_idx):
            x, y, probe, worker = batch
            self.probes.append((self.current_epoch, int(worker[0]), probe))
            return torch.nn.functional.mse_loss(self.net(x), y)

        def predict_step(self, batch, batch_idx):
            self.predictions.append(torch.rand(2))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return DropoutNet()


def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _fit(epochs: int, ckpt_dir: str | None = None, ckpt_path: str | None = None):
    import torch.distributed as dist
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", 0))
    torch.manual_seed(100 + rank)  # deliberately different initial weights per rank
    model = _make_module()
    callbacks = [RankAwareSeed(SEED)]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1))
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=epochs,
        callbacks=callbacks,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    # An unshuffled shard: the randomness under test is dropout and augmentation. A shuffled shard
    # with workers hits Lightning issue 21938 on resume (see RankAwareSeed.on_train_start).
    data = _AugmentedData()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer, model, rank


def _fit_and_resume(out_dir: str) -> dict:
    import torch.distributed as dist

    # A: 2 epochs uninterrupted, with checkpointing
    trainer, model_a, rank = _fit(2, ckpt_dir=f"{out_dir}/a")
    trainer.predict(model_a, torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=2))
    # B: 1 epoch, stop; C: resume from B's checkpoint for the second epoch
    _fit(1, ckpt_dir=f"{out_dir}/b")
    _, model_c, _ = _fit(2, ckpt_path=f"{out_dir}/b/epoch=0.ckpt")
    # D (control): the same resume from a checkpoint stripped of the RankAwareSeed states
    checkpoint = torch.load(f"{out_dir}/b/epoch=0.ckpt", weights_only=True)
    assert checkpoint["callbacks"].pop("RankAwareSeed") is not None
    torch.save(checkpoint, f"{out_dir}/stripped{rank}.ckpt")
    dist.barrier()
    _, model_d, _ = _fit(2, ckpt_path=f"{out_dir}/stripped{rank}.ckpt")
    return {
        "setup_draw": model_a.setup_draw,
        "start_params": model_a.start_params,
        "start_draw": model_a.start_draw,
        "probes_a": model_a.probes,
        "predictions": torch.stack(model_a.predictions),
        "final_a": _flat(model_a),
        "probes_c": model_c.probes,
        "final_c": _flat(model_c),
        "final_d": _flat(model_d),
    }


@pytest.mark.slow
def test_lightning_ddp_streams_identical_init_and_exact_resume():
    from ddp_plugins.testing import run_lightning

    ranks = run_lightning(_fit_and_resume, world_size=2, timeout=400)

    # model initialization identical on every rank, per-rank streams from on_train_start
    assert torch.equal(ranks[0]["setup_draw"], ranks[1]["setup_draw"]), "setup ran under different seeds"
    assert torch.equal(ranks[0]["start_params"], ranks[1]["start_params"]), "parameters differ at train start"
    assert not torch.equal(ranks[0]["start_draw"], ranks[1]["start_draw"]), "ranks share one training stream"
    assert not torch.equal(ranks[0]["predictions"], ranks[1]["predictions"]), "ranks share one predict stream"

    # DataLoader workers: one stream per (rank, worker, epoch), every generator distinct
    streams = defaultdict(list)
    for rank, result in enumerate(ranks):
        for epoch, worker, probe in result["probes_a"]:
            streams[rank, epoch, worker].append(probe)
    assert sorted(streams) == [(r, e, w) for r in range(2) for e in range(2) for w in range(2)], sorted(streams)
    first = torch.stack([torch.cat(probes)[0] for probes in streams.values()])  # first item of each stream
    for column, name in enumerate(("torch", "NumPy", "Python")):
        assert len(set(first[:, column].tolist())) == len(streams), f"{name} worker streams repeat: {first}"

    # exact resume: bit for bit, and the epoch-2 augmentations were the same draws
    for rank, result in enumerate(ranks):
        assert torch.equal(result["final_c"], result["final_a"]), (
            f"rank {rank}: resumed run differs from the uninterrupted one by "
            f"{(result['final_c'] - result['final_a']).abs().max().item():.3g}"
        )
        epoch2_a = [probe for epoch, _, probe in result["probes_a"] if epoch == 1]
        epoch2_c = [probe for epoch, _, probe in result["probes_c"] if epoch == 1]
        assert len(epoch2_c) == len(epoch2_a) > 0 and all(map(torch.equal, epoch2_a, epoch2_c))
        # control: without the saved states the second epoch draws differently
        assert not torch.equal(result["final_d"], result["final_a"]), f"rank {rank}: the RNG states changed nothing"
    assert torch.equal(ranks[0]["final_a"], ranks[1]["final_a"]), "DDP replicas diverged"
