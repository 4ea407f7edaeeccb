"""The reproducible mode is exact, or refuses in one line what it cannot make exact (issue 43).

Each case is something that would make the bits depend on the number of ranks: options the mode
bypasses, a torchmetrics object that sums floats logged, a buffer the forward updates, shards too small for
BatchNorm1d. Python's and NumPy's random streams are reseeded per shard like torch's.
"""

from __future__ import annotations

import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from ddp_plugins.core.plan import GlobalPlan
from ddp_plugins.core.reproducible import ShardedStep, shard_seed
from ddp_plugins.lightning.reproducible import check_shards
from ddp_plugins.lightning.strategy import DDPPluginsStrategy

pytestmark = pytest.mark.usefixtures("clean_process_state")  # Trainers of the pack's strategy run here

ROWS = 49


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and message.endswith("."), f"not one whole sentence: {message!r}"
    return message


@pytest.mark.parametrize(
    ("option", "value"),
    [("comm_hook", "fp16"), ("find_unused_parameters", True), ("ddp_comm_hook", lambda state, bucket: None)],
)
def test_options_the_mode_bypasses_are_refused(option, value):
    with pytest.raises(ValueError) as error:
        DDPPluginsStrategy(global_batch_size=16, reproducible=True, **{option: value})
    assert _one_line(error).startswith(f"`{option}` should be"), str(error.value)
    assert "with reproducible=True" in str(error.value) and "outside DistributedDataParallel's reducer" in str(
        error.value
    )
    DDPPluginsStrategy(global_batch_size=16, **{option: value})  # the default mode takes them


class _EMA(nn.Module):
    """A normalizer that keeps an average of its input in a buffer, updated in forward."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))

    def forward(self, x):
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x - self.mean


class _Model(pl.LightningModule):
    def __init__(self, body: nn.Module, log_metric: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.log_metric = nn.Sequential(body, nn.Linear(4, 3)), log_metric
        self.mean = MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        if self.log_metric:
            self.mean(logits.max(dim=1).values)
            self.log("train/top", self.mean, sync_dist=True)
        return cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randn(ROWS, 4, generator=g), torch.randint(0, 3, (ROWS,), generator=g)), 8
        )


def _fit(model, global_batch_size=40):
    strategy = DDPPluginsStrategy(global_batch_size=global_batch_size, reproducible=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy,
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)


def test_a_logged_torchmetrics_object_summing_floats_is_refused_with_the_alternative():
    """Accuracy's integer counts sum exactly in any grouping (the demo logs one); a float sum does not."""
    with pytest.raises(ValueError) as error:
        _fit(_Model(nn.Identity(), log_metric=True))
    message = _one_line(error)
    assert "torchmetrics MeanMetric logged as 'train/top' exactly: its state 'mean_value'" in message, message
    assert "SequentialEvaluation(metrics=...)" in message


def test_a_buffer_updated_in_forward_is_refused_by_name():
    with pytest.raises(ValueError) as error:
        _fit(_Model(_EMA(4)))
    assert "the forward updated buffer 'net.0.mean'" in _one_line(error), str(error.value)


def test_shards_too_small_for_batchnorm1d_are_refused_before_the_first_step():
    # 49 rows, G = 40: the last step of 9 rows is cut into 8 shards of 2, 1, 1, ... rows
    with pytest.raises(ValueError) as error:
        _fit(_Model(nn.BatchNorm1d(4)), global_batch_size=40)
    message = _one_line(error)
    assert "step 1 has 9 rows" in message and "virtual_shards<=4" in message, message
    plan = GlobalPlan(49, 40, drop_last=True, virtual_shards=8)  # what the message offers works
    check_shards(nn.BatchNorm1d(4), plan)
    check_shards(nn.BatchNorm1d(4), GlobalPlan(49, 40, virtual_shards=4))
    check_shards(nn.BatchNorm2d(4), GlobalPlan(49, 40, virtual_shards=8))  # a conv map has rows x pixels


def test_python_and_numpy_streams_are_the_shards_own_and_given_back(isolated):
    model = nn.Linear(2, 1)
    random.seed(1)
    np.random.seed(1)
    before = random.getstate(), np.random.get_state()[1].copy()
    draws = {}
    step = ShardedStep(model, virtual_shards=4, seed=5)
    for shard in (2, 3):  # this rank's shards; shard 3 draws the same on any split
        with step.shard(shard, rows=1, epoch=0, step=7):
            draws[shard] = (random.random(), float(np.random.rand()))
            model(torch.ones(1, 2)).sum().backward()
    step.finish(step_rows=2)
    seed = shard_seed(5, 0, 7, 3)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    assert draws[3] == (random.random(), float(np.random.rand()))
    assert draws[2] != draws[3]
    assert random.getstate() != before[0]  # (reseeded just above) ...
    step = ShardedStep(model, virtual_shards=4, seed=5)
    random.seed(1)
    np.random.seed(1)
    with step.shard(0, rows=1, epoch=0, step=0):
        model(torch.ones(1, 2)).sum().backward()
    step.finish(step_rows=1)
    assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1]), "not given back"


def test_float16_is_refused_and_bfloat16_taken():
    strategy = DDPPluginsStrategy(global_batch_size=40, reproducible=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="16-true", logger=False, strategy=strategy)
    with pytest.raises(ValueError) as error:
        trainer.fit(_Model(nn.Identity()))
    message = _one_line(error)
    assert message.startswith("`precision` should be '32-true', '64-true' or 'bf16-mixed' with reproducible=True")
    assert "got '16-true'" in message and "loss scaler" in message, message


def test_switching_the_mode_on_a_resume_is_said_in_one_line(tmp_path, caplog):
    """At an epoch's end the mode may change (mid-epoch the plan's check refuses it), and the log says so."""

    def fit(reproducible, epochs, ckpt_path=None):
        strategy = DDPPluginsStrategy(global_batch_size=40, reproducible=reproducible)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, max_epochs=epochs, logger=False, enable_progress_bar=False,
            enable_checkpointing=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(_Model(nn.Identity()), ckpt_path=ckpt_path)
        return trainer

    fit(False, 1).save_checkpoint(tmp_path / "default.ckpt")
    with caplog.at_level("WARNING", logger="ddp_plugins"):
        fit(True, 2, tmp_path / "default.ckpt").save_checkpoint(tmp_path / "reproducible.ckpt")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume:")]
    assert said == [
        "resume: the checkpoint was trained with reproducible=False and this run goes on with reproducible=True"
        " (virtual_shards=8): its bits from here on are the same only as those of runs resumed the same way, not of"
        " one run in either mode."
    ], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="ddp_plugins"):
        fit(False, 3, tmp_path / "reproducible.ckpt")
    assert [r.getMessage() for r in caplog.records if "reproducible=True (virtual_shards=8) and this" in r.getMessage()]


class _Started(pl.Callback):
    """Records a rank's ``setup`` (none may run after a refusal before launch)."""

    def __init__(self) -> None:
        self.ranks: list[int] = []

    def setup(self, trainer, pl_module, stage):
        self.ranks.append(trainer.global_rank)


def _fit_refused_before_launch(model, monkeypatch, gpus=False, fit_loader=None, **trainer_args):
    """``Trainer.fit`` on 2 spawned ranks, where spawning or a rank's setup fails the test: the error raised."""

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", no_ranks)
    started = _Started()
    strategy = DDPPluginsStrategy(backend="gloo", global_batch_size=40, reproducible=True, start_method="spawn")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, callbacks=[started, *trainer_args.pop("callbacks", [])],
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, **trainer_args,
    )  # fmt: skip
    if gpus:  # what a Trainer on 2 GPUs holds (CUDA is mocked: this machine need not have one)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        strategy.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(ValueError) as error:
        trainer.fit(model, train_dataloaders=fit_loader)
    assert started.ranks == [], "a rank started before the refusal"
    return error


@pytest.fixture
def kernels():
    """Gives back torch's deterministic-algorithm flags (a Trainer's `deterministic` sets them process-wide)."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = torch.backends.cudnn.deterministic
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic = cudnn


@pytest.mark.usefixtures("clean_process_state", "kernels")
@pytest.mark.parametrize(("deterministic", "got"), [(None, "nondeterministic"), ("warn", "warn-only deterministic")])
def test_nondeterministic_kernels_on_cuda_are_refused_before_any_rank_starts(monkeypatch, deterministic, got):
    torch.use_deterministic_algorithms(False)
    error = _fit_refused_before_launch(_Model(nn.Identity()), monkeypatch, gpus=True, deterministic=deterministic)
    message = _one_line(error)
    assert message.startswith(f"reproducible=True on CUDA needs deterministic kernels, got {got} kernels"), message
    assert "Use Trainer(deterministic=True)" in message


@pytest.mark.usefixtures("clean_process_state", "kernels")
def test_deterministic_kernels_on_cuda_pass_the_check_before_launch(monkeypatch):
    from ddp_plugins.lightning.rank_aware_seed import RankAwareSeed
    from ddp_plugins.lightning.reproducible import check_deterministic

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for args in ({"deterministic": True}, {"callbacks": [RankAwareSeed(0, deterministic=True)]}):
        torch.use_deterministic_algorithms(False)
        strategy = DDPPluginsStrategy(global_batch_size=40, reproducible=True)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, **args)
        strategy.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
        check_deterministic(trainer)  # Trainer(deterministic=True) set them; RankAwareSeed sets them in setup
    strategy.parallel_devices = [torch.device("cpu")] * 2
    trainer.callbacks.clear()
    torch.use_deterministic_algorithms(False)
    check_deterministic(trainer)  # the CPU's kernels are the same on any number of ranks


@pytest.mark.usefixtures("clean_process_state")
def test_shards_too_small_for_batchnorm1d_are_refused_before_any_rank_starts(monkeypatch):
    # G = 40 of 8 shards of 5 rows: fine; the loader given to fit has 49 rows, a last step of 9 rows cut 2, 1, 1, ...
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(ROWS, 4, generator=g), torch.randint(0, 3, (ROWS,), generator=g)), 8)
    message = _one_line(_fit_refused_before_launch(_Model(nn.BatchNorm1d(4)), monkeypatch, fit_loader=loader))
    assert message.startswith("`virtual_shards` should be at most 4 with reproducible=True, as BatchNorm1d 'net.0'")
    assert "got 8: step 1 has 9 rows" in message and "virtual_shards<=4" in message, message
    # without a loader the launching process knows a whole step: 40 rows in 32 shards has shards of 1 row
    strategy = DDPPluginsStrategy(global_batch_size=40, reproducible=True, virtual_shards=32, start_method="spawn")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)  # spawning fails the test
    with pytest.raises(ValueError) as error:
        trainer.fit(_Model(nn.BatchNorm1d(4)))
    assert "got 32: step 0 has 40 rows" in _one_line(error), str(error.value)


@pytest.mark.parametrize(
    ("loader", "named"),
    [
        (DataLoader(TensorDataset(torch.zeros(20, 2)), batch_size=8, drop_last=True), "drop_last=True"),
        (DataLoader(TensorDataset(torch.zeros(20, 2)), batch_size=None), "batch_size=None"),
    ],
    ids=["drop_last", "no batch_size"],
)
def test_an_evaluation_loader_it_cannot_cut_into_the_same_batches_is_refused_by_its_setting(loader, named):
    """Equal batch counts on every rank need the dataset's batches of ``batch_size`` rows, all of them."""
    steps = DDPPluginsStrategy(global_batch_size=8, reproducible=True)._steps
    with pytest.raises(ValueError, match="evaluates the same batches on any number of ranks") as error:
        steps.evaluation_loader(loader, 2, 0)
    assert named in _one_line(error)
    kept = DataLoader(TensorDataset(torch.zeros(20, 2)), batch_size=8)
    cut = [[len(b[0]) for b in steps.evaluation_loader(kept, 2, rank)] for rank in (0, 1)]
    assert cut == [[8, 8], [8, 4]], "rank 0: a real batch and a padding one; rank 1: the last two batches"
