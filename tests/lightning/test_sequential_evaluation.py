"""SequentialEvaluation (the Lightning adapter): exact, ordered results and metrics, equal to one process.

Every distributed result is compared with a single-process reference computed here: the same
model run on the whole dataset in this process. The sampler and the gather it builds on are tested
in tests/core/test_samplers.py and tests/core/test_collectives.py.
"""

import doctest
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Sampler, SequentialSampler
from torchmetrics.classification import MulticlassAccuracy

import ddp_plugins.lightning.sequential_evaluation
from ddp_plugins.lightning.sequential_evaluation import SequentialEvaluation
from ddp_plugins.testing import check_ok, loopback_env, run_command, run_lightning
from tests.helpers import REPO_ROOT

NUM_CLASSES, FEATURES, PAD = 10, 8, -100


# ---------------------------------------------------------------- data, model, reference


class _Data(Dataset):
    """Features, a label, a string id and a variable-length token sequence per sample."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, FEATURES, generator=gen)
        self.y = torch.randint(0, NUM_CLASSES, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        length = 1 + i // 150  # grows along the dataset: ragged across batches and across ranks
        return {"x": self.x[i], "y": self.y[i], "id": f"id-{i:05d}", "tokens": torch.arange(length) + i}


def _collate(samples: list) -> dict:
    width = max(len(s["tokens"]) for s in samples)
    tokens = torch.full((len(samples), width), PAD)
    for row, s in enumerate(samples):
        tokens[row, : len(s["tokens"])] = s["tokens"]
    return {
        "x": torch.stack([s["x"] for s in samples]),
        "y": torch.stack([s["y"] for s in samples]),
        "id": [s["id"] for s in samples],
        "tokens": tokens,
    }


def _loader(n: int, batch_size: int = 16, **kwargs) -> DataLoader:
    return DataLoader(_Data(n), batch_size=batch_size, collate_fn=_collate, **kwargs)


class _Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(FEATURES, NUM_CLASSES)
        self.plain_acc = MulticlassAccuracy(NUM_CLASSES, average="micro")

    def forward(self, x):
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        logits = self(batch["x"])
        # plain Lightning: a torchmetrics metric synced over ranks (counts DistributedSampler's duplicates)
        self.plain_acc(logits, batch["y"])
        self.log("plain_acc", self.plain_acc, on_epoch=True)
        return {"preds": logits, "target": batch["y"]}

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def test_step(self, batch, batch_idx):
        return {"preds": self(batch["x"]), "target": batch["y"]}

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return {"out": {"logits": self(batch["x"]), "tokens": batch["tokens"]}, "ids": batch["id"]}


def _reference(n: int, weights: dict | None = None) -> dict:
    """One process, the whole dataset, no sampler at all."""
    data, model = _Data(n), _Model()
    if weights is not None:
        model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(data.x)
    width = max(1 + i // 150 for i in range(n))
    tokens = torch.full((n, width), PAD)
    for i in range(n):
        tokens[i, : 1 + i // 150] = torch.arange(1 + i // 150) + i
    acc = MulticlassAccuracy(NUM_CLASSES, average="micro")(logits, data.y)
    return {"logits": logits, "tokens": tokens, "ids": [f"id-{i:05d}" for i in range(n)], "y": data.y, "acc": acc}


def _assert_predictions_equal_reference(predict: dict, ref: dict, n: int) -> None:
    assert predict["ids"] == ref["ids"], "gathered ids are not the dataset's ids in dataset order"
    assert predict["out"]["logits"].shape == (n, NUM_CLASSES), "one row per sample, padding dropped"
    torch.testing.assert_close(predict["out"]["logits"], ref["logits"], msg="logits differ from one process")
    assert torch.equal(predict["out"]["tokens"], ref["tokens"]), "ragged tokens differ from one process"


# ---------------------------------------------------------------- the callback, in-process checks


def test_callback_checks_its_arguments():
    with pytest.raises(ValueError, match=r"^`stages` should be one of 'validate', 'test', 'predict', got 'fit'\.$"):
        SequentialEvaluation(stages=["fit"])
    with pytest.raises(TypeError, match=r"^`metrics` should be a mapping of names .* got 'acc': float\.$"):
        SequentialEvaluation(metrics={"acc": 0.5})
    with pytest.raises(TypeError, match=r"^`pad_value` should be a finite number or None, got 'x'\.$"):
        SequentialEvaluation(pad_value="x")


class _EveryOther(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return (self.n + 1) // 2


class _Stream(IterableDataset):
    def __iter__(self):
        for _ in range(8):
            yield {"x": torch.zeros(FEATURES), "y": torch.tensor(0)}


@pytest.mark.parametrize(
    ("loader", "error", "match"),
    [
        (lambda: _loader(20, sampler=_EveryOther(20)), TypeError, "custom sampler _EveryOther"),
        (lambda: DataLoader(_Stream(), batch_size=4), TypeError, "IterableDataset has no length.*distributed_concat"),
        (lambda: _loader(20, drop_last=True), ValueError, "drop_last=True"),
        (
            lambda: DataLoader(_Data(20), batch_sampler=BatchSampler(SequentialSampler(range(20)), 4, False)),
            TypeError,
            r"^SequentialEvaluation needs `val_dataloader` to batch with `batch_size=...`,"
            r" got `batch_sampler=BatchSampler\(...\)`",
        ),
    ],
)
def test_callback_refuses_dataloaders_it_cannot_make_exact(loader, error, match):
    trainer = Trainer(
        accelerator="cpu", devices=1, callbacks=[SequentialEvaluation()], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    with pytest.raises(error, match=match) as err:
        trainer.validate(_Model(), loader(), verbose=False)
    assert "\n" not in str(err.value), "the refusal must be one line"


def test_docstring_examples_run():
    assert doctest.testmod(ddp_plugins.lightning.sequential_evaluation).failed == 0


def test_hydra_config_instantiates_the_callback():
    from hydra.utils import instantiate

    from ddp_plugins.app.config import compose_config

    path = REPO_ROOT / "conf" / "callbacks" / "sequential_evaluation.yaml"
    assert path.read_text().startswith("# @package callbacks.sequential_evaluation\n")
    cfg = compose_config(["callbacks=[sequential_evaluation]", "model.num_classes=5"])
    callback = instantiate(cfg.callbacks.sequential_evaluation)
    assert isinstance(callback, SequentialEvaluation)
    assert callback.stages == ("validate", "test", "predict")
    assert cfg.callbacks.sequential_evaluation.metrics.exact_acc.num_classes == 5, "metric follows the model"


# ---------------------------------------------------------------- Trainer level: strategy="ddp", 2 ranks


def _run_ddp(out_dir, n, tiny):
    def trainer(callbacks, **kwargs):
        return Trainer(
            accelerator="cpu", devices=2, strategy="ddp", callbacks=callbacks, logger=False,
            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, **kwargs,
        )  # fmt: skip

    callback = SequentialEvaluation(metrics={"acc": MulticlassAccuracy(NUM_CLASSES, average="micro")}, pad_value=PAD)
    exact = trainer([callback])
    exact.validate(_Model(), _loader(n), verbose=False)
    val_acc = exact.callback_metrics["val/acc"].clone()
    exact.test(_Model(), _loader(n), verbose=False)
    test_acc = exact.callback_metrics["test/acc"].clone()
    exact.predict(_Model(), _loader(n), return_predictions=False)
    predict = callback.results.get("predict")
    exact.predict(_Model(), _loader(tiny), return_predictions=False)
    plain = trainer([])
    plain.validate(_Model(), _loader(n), verbose=False)
    during_fit = SequentialEvaluation(metrics={"acc": MulticlassAccuracy(NUM_CLASSES, average="micro")})
    fitter = trainer([during_fit], max_epochs=1, limit_train_batches=3, num_sanity_val_steps=2)
    model = _Model()
    fitter.fit(model, _loader(n), _loader(n))
    return {
        "fit_validate": during_fit.results.get("validate"),
        "fit_acc": fitter.callback_metrics["val/acc"],
        "fit_weights": model.state_dict(),
        "val_acc": val_acc,
        "test_acc": test_acc,
        "plain_acc": plain.callback_metrics["plain_acc"],
        "predict": predict,
        "tiny": callback.results.get("predict"),
        "validate": callback.results.get("validate"),
    }


@pytest.mark.slow
def test_ddp_results_and_metrics_equal_one_process_where_plain_lightning_does_not():
    n, tiny = 1001, 1
    ranks = run_lightning(_run_ddp, n, tiny, world_size=2, timeout=240)
    ref = _reference(n)
    rank0 = ranks[0]
    _assert_predictions_equal_reference(rank0["predict"], ref, n)
    torch.testing.assert_close(rank0["validate"]["preds"], ref["logits"])
    assert torch.equal(rank0["validate"]["target"], ref["y"])
    for out in ranks:
        assert out["val_acc"].item() == ref["acc"].item(), "logged val accuracy is not the one-process accuracy"
        assert out["test_acc"].item() == ref["acc"].item(), "logged test accuracy is not the one-process accuracy"
        assert out["plain_acc"].item() != ref["acc"].item(), "this case must show plain Lightning's duplicate bias"
    _assert_predictions_equal_reference(rank0["tiny"], _reference(tiny), tiny)
    assert ranks[1]["predict"] is None, "results are kept on rank 0 only"
    trained = _reference(n, rank0["fit_weights"])  # validation inside fit, after training, sanity check skipped
    assert not torch.equal(trained["logits"], ref["logits"]), "the fit must have changed the weights"
    torch.testing.assert_close(rank0["fit_validate"]["preds"], trained["logits"])
    assert rank0["fit_acc"].item() == ranks[1]["fit_acc"].item() == trained["acc"].item()


# ---------------------------------------------------------------- ddp_plugins_notebook / _spawn: the calling process


def _run_launched(out_file, n, output_dir):
    metric = MulticlassAccuracy(NUM_CLASSES, average="micro")
    report = {}
    for strategy, kwargs in (("ddp_plugins_notebook", {}), ("ddp_plugins_spawn", {"output_dir": output_dir})):
        callback = SequentialEvaluation(metrics={"acc": metric}, pad_value=PAD, **kwargs)
        trainer = Trainer(
            accelerator="cpu", devices=2, strategy=strategy, callbacks=[callback], logger=False,
            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.validate(_Model(), _loader(n), verbose=False)
        trainer.predict(_Model(), _loader(n), return_predictions=False)
        report[strategy] = {
            "val_acc": trainer.callback_metrics["val/acc"],
            "metric_values": callback.metric_values,
            "results": callback.results,
            "paths": callback.paths,
        }
    torch.save(report, out_file)


@pytest.mark.slow
@pytest.mark.e2e  # 90 s here (two launchers, each starting its ranks): make test-e2e
def test_results_reach_the_calling_process_under_our_notebook_and_spawn_strategies(tmp_path):
    n, out_file = 4001, tmp_path / "report.pt"  # results of ~1 MB: more than a pipe buffer holds
    code = (
        "import sys\nfrom ddp_plugins.core import run_main\n"
        "from tests.lightning.test_sequential_evaluation import _run_launched\n"
        "if __name__ == '__main__':\n    run_main(lambda: _run_launched(sys.argv[1], int(sys.argv[2]), sys.argv[3]))\n"
    )
    script = tmp_path / "launch_eval.py"
    script.write_text(code)
    cmd = [sys.executable, str(script), str(out_file), str(n), str(tmp_path / "results")]
    check_ok(run_command(cmd, timeout=240, env=loopback_env()))
    report, ref = torch.load(out_file, weights_only=True), _reference(n)

    notebook = report["ddp_plugins_notebook"]
    _assert_predictions_equal_reference(notebook["results"]["predict"], ref, n)
    torch.testing.assert_close(notebook["results"]["validate"]["preds"], ref["logits"])
    assert notebook["val_acc"].item() == ref["acc"].item()
    assert notebook["metric_values"]["validate"]["val/acc"].item() == ref["acc"].item()

    spawn = report["ddp_plugins_spawn"]
    assert spawn["results"] == {}, "with output_dir the results live in files, not in memory"
    assert Path(spawn["paths"]["predict"]).parent == tmp_path / "results"
    _assert_predictions_equal_reference(torch.load(spawn["paths"]["predict"], weights_only=True), ref, n)
    validate = torch.load(spawn["paths"]["validate"], weights_only=True)
    assert torch.equal(validate["target"], ref["y"])
    assert spawn["val_acc"].item() == ref["acc"].item()
    assert not list((tmp_path / "results").glob(".*.tmp")), "temporary files left behind"
    assert notebook["results"]["predict"]["out"]["tokens"].numel() * 8 > 2**16, "the payload must exceed a pipe"
