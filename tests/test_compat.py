"""Every private Lightning/torch/Hydra name the pack uses still exists in the installed versions.

That the pack uses no private name that ``_compat`` does not list, and imports them only there, is
checked in ``tests/test_claims.py``, with the package's other claims.
"""

import importlib
import inspect
import subprocess
import sys

import hydra
import lightning
import pytest
import torch

from ddp_plugins import _compat

_VERSIONS = f"torch {torch.__version__} / lightning {lightning.__version__} / hydra-core {hydra.__version__}"
_UPDATE = "ddp_plugins/_compat.py names the versions it was checked against: update it there."


def _resolve(module, path):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("module", "path"), _compat.CHECKED, ids=[f"{m}:{p}" for m, p in _compat.CHECKED])
def test_private_name_still_exists(module, path):
    try:
        obj = _resolve(module, path)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{module}.{path} is gone in {_VERSIONS} ({err}); {_UPDATE}")
    assert callable(obj), f"{module}.{path} is no longer callable in {_VERSIONS}; {_UPDATE}"


def _trainer():
    from lightning.pytorch import Trainer

    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)


# An instance of each class of CHECKED_ATTRIBUTES, built the way Lightning builds it.
_INSTANCES = {
    "DDPStrategy": lambda cls, tmp_path: cls(),
    "_MultiProcessingLauncher": lambda cls, tmp_path: cls(_trainer().strategy, start_method="spawn"),
    "CSVLogger": lambda cls, tmp_path: cls(tmp_path),
    "TensorBoardLogger": lambda cls, tmp_path: cls(tmp_path),
    "CombinedLoader": lambda cls, tmp_path: cls([[1, 2]], mode="sequential"),
    "_EvaluationLoop": lambda cls, tmp_path: _trainer().validate_loop,
    "_PredictionLoop": lambda cls, tmp_path: _trainer().predict_loop,
    "_TrainingEpochLoop": lambda cls, tmp_path: _trainer().fit_loop.epoch_loop,
    "Trainer": lambda cls, tmp_path: _trainer(),
    "LightningModule": lambda cls, tmp_path: cls(),
}


@pytest.mark.parametrize(
    ("module", "name", "attributes"),
    _compat.CHECKED_ATTRIBUTES,
    ids=[f"{m}:{n}" for m, n, _ in _compat.CHECKED_ATTRIBUTES],
)
def test_private_attribute_still_set(module, name, attributes, tmp_path):
    try:
        cls = _resolve(module, name)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{module}.{name} is gone in {_VERSIONS} ({err}); {_UPDATE}")
    assert name in _INSTANCES, f"tests/test_compat.py needs a way to build a {name} (_INSTANCES)"
    instance = _INSTANCES[name](cls, tmp_path)
    assert isinstance(instance, cls), f"expected a {name}, got {type(instance).__name__}"
    missing = [attr for attr in attributes if not hasattr(instance, attr)]
    assert missing == [], f"a {module}.{name} has no {', '.join(missing)} in {_VERSIONS}; {_UPDATE}"


def test_compat_accessors_work_on_a_strategy():
    from lightning.pytorch.strategies import DDPStrategy

    def hook(state, bucket):
        return bucket

    strategy = DDPStrategy(ddp_comm_hook=hook, ddp_comm_state="state")
    assert _compat.strategy_comm_hook(strategy) is hook
    assert _compat.strategy_comm_state_and_wrapper(strategy) == ("state", None)


def _result_objects():
    """A result collection as Lightning's training loop builds it, holding one value logged with sync_dist."""
    from lightning.pytorch.trainer.connectors.logger_connector import result

    collection = result._ResultCollection(training=True)
    collection.log("training_step", "loss", torch.tensor(2.0), on_epoch=True, sync_dist=True, batch_size=4)
    entry = collection["training_step.loss"]
    return {"_ResultCollection": collection, "_ResultMetric": entry, "_Metadata": entry.meta, "_Sync": entry.meta.sync}


def missing_result_members(objects):
    """The members and call parameters of ``_compat.RESULT_MEMBERS``/``RESULT_CALLS`` ``objects`` lack."""
    missing = [f"{cls}.{m}" for cls, members in _compat.RESULT_MEMBERS.items() for m in members
               if not hasattr(objects[cls], m)]  # fmt: skip
    for call, parameters in _compat.RESULT_CALLS.items():
        cls, _, method = call.partition(".")
        found = inspect.signature(getattr(objects[cls], method)).parameters if hasattr(objects[cls], method) else {}
        missing += [f"{call}({p}=)" for p in parameters if p not in found]
    return missing


def test_every_member_of_the_result_collection_the_pack_uses_is_there():
    missing = missing_result_members(_result_objects())
    assert missing == [], f"Lightning's result collection lacks {', '.join(missing)} in {_VERSIONS}; {_UPDATE}"


def test_a_renamed_member_of_the_result_collection_is_caught(monkeypatch):
    """Lightning renaming one member (here in this process only) fails the check above, by name."""
    from lightning.pytorch.trainer.connectors.logger_connector import result

    objects = _result_objects()
    monkeypatch.setattr(result._Metadata, "is_averaged", result._Metadata.is_mean_reduction, raising=False)
    monkeypatch.delattr(result._Metadata, "is_mean_reduction")
    update = result._ResultCollection.update_metrics
    monkeypatch.setattr(
        result._ResultCollection, "update_metrics", lambda self, key, value, size: update(self, key, value, size)
    )
    assert missing_result_members(objects) == [
        "_Metadata.is_mean_reduction",
        "_ResultCollection.update_metrics(batch_size=)",
    ]


def test_a_torch_below_the_floor_is_refused_at_import_in_one_line():
    """``import ddp_plugins`` on a torch older than the floor says which torch it needs, before anything fails."""
    code = "import torch; torch.__version__ = '2.9.1+cpu'; import ddp_plugins"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    floor = ".".join(map(str, _compat.TORCH_FLOOR))
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        f"ImportError: ddp_plugins needs torch {floor} or newer, got torch 2.9.1+cpu: pip install 'torch>={floor}'"
    )
