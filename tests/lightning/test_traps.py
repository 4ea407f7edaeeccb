"""The traps next door (docs/compatibility.md): what fails the same with Lightning's own DDP, and the
one line the pack says first. One CPU rank, in this process."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugins import _compat
from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.lightning import AccumulationNoSync, DDPPluginsStrategy
from ddp_plugins.lightning.traps import COMPILED_MODULE_WARNING, check_static_graph, warn_compiled_module

pytestmark = pytest.mark.usefixtures("clean_process_state")  # Trainers of the pack's strategy run here

REDUCER_ASSERT = "expect_autograd_hooks_ INTERNAL ASSERT FAILED"
STATIC_GRAPH_REFUSAL = (
    "`static_graph` should be False when the first optimizer step accumulates gradients, got True with 2"
    " micro-batches per step from the first one."
)


class _Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        rows = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator))
        return DataLoader(rows, batch_size=4)


def _trainer(strategy, max_steps=2, **kwargs):
    return pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def _ours(**kwargs):
    return DDPPluginsStrategy(backend="gloo", stall_name_after=None, **kwargs)


def _lightning_s(**kwargs):
    return DDPStrategy(process_group_backend="gloo", **kwargs)


# ---------------------------------------------------------------- a LightningModule compiled whole


@pytest.mark.skipif(not _compat.DYNAMO_FAILS_IN_SELF_LOG, reason="torch 2.10, 2.11, 2.14 train it: the test below")
def test_a_module_compiled_whole_is_named_in_one_line_before_dynamo_fails():
    trainer = _trainer(_ours())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Exception, match="has no attribute '__dict__'") as failure:
            trainer.fit(torch.compile(_Regression()))
    ours = [str(w.message) for w in caught if "compiled whole" in str(w.message)]
    assert ours == [COMPILED_MODULE_WARNING], f"one warning, the pack's line, expected; got {ours}"
    assert "\n" not in COMPILED_MODULE_WARNING
    assert "self.net = torch.compile(self.net)" in COMPILED_MODULE_WARNING
    assert "self.log(" in str(failure.value), "dynamo's own message points at the user's `self.log`"


def test_lightning_s_own_ddp_fails_the_same_on_a_module_compiled_whole():
    if _compat.DYNAMO_FAILS_IN_SELF_LOG:
        with pytest.raises(Exception, match="has no attribute '__dict__'"):
            _trainer(_lightning_s()).fit(torch.compile(_Regression()))
        return
    _trainer(_lightning_s()).fit(torch.compile(_Regression()))  # torch 2.10, 2.11, 2.14: it trains


@pytest.mark.skipif(_compat.DYNAMO_FAILS_IN_SELF_LOG, reason="torch 2.12, 2.13: dynamo fails in `self.log`: above")
def test_a_module_compiled_whole_trains_without_the_warning_where_dynamo_traces_self_log():
    model, trainer = torch.compile(_Regression()), _trainer(_ours())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert not [w for w in caught if "compiled whole" in str(w.message)], "no warning where nothing fails"
    assert trainer.global_step == 2


def test_the_inner_network_compiled_trains_without_the_warning():
    model = _Regression()
    model.net = torch.compile(model.net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(_ours()).fit(model)
    assert not [w for w in caught if "compiled whole" in str(w.message)], "no warning for the fix it names"
    assert warn_compiled_module(model) is False and warn_compiled_module(None) is False


# ---------------------------------------------------------------- static_graph with accumulation


@pytest.mark.parametrize(
    "accumulation",
    [{"accumulate_grad_batches": 2}, {"callbacks": [AccumulationNoSync(2)]}],
    ids=["trainer", "AccumulationNoSync"],
)
def test_static_graph_with_accumulation_from_the_first_step_is_refused_in_one_line(accumulation):
    with pytest.raises(ArgumentValueError) as refusal:
        _trainer(_ours(static_graph=True), **accumulation).fit(_Regression())
    message = str(refusal.value)
    assert message.startswith(STATIC_GRAPH_REFUSAL), message
    assert "\n" not in message and "static_graph=False" in message


def test_lightning_s_own_ddp_hits_the_reducer_s_assert_there():
    with pytest.raises(RuntimeError, match=REDUCER_ASSERT):
        _trainer(_lightning_s(static_graph=True), accumulate_grad_batches=2).fit(_Regression())


@pytest.mark.parametrize(
    ("strategy", "accumulation"),
    [
        (_ours, {"callbacks": [AccumulationNoSync({0: 1, 1: 2})]}),
        (_ours, {"callbacks": [GradientAccumulationScheduler({1: 2})]}),
        (_ours, {}),
        (_lightning_s, {"callbacks": [AccumulationNoSync({0: 1, 1: 2})]}),
    ],
    ids=["ours-AccumulationNoSync-from-epoch-1", "ours-scheduler-from-epoch-1", "ours-no-accumulation", "lightning"],
)
def test_static_graph_passes_when_the_first_step_syncs(strategy, accumulation):
    trainer = _trainer(strategy(static_graph=True), max_steps=6, **accumulation)  # epoch 1 accumulates
    trainer.fit(_Regression())
    assert trainer.global_step == 6 and trainer.current_epoch >= 1, "it ran into the accumulating epoch"


def test_no_ddp_model_no_check():
    check_static_graph(_trainer("auto", accumulate_grad_batches=4))
