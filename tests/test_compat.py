"""Every private Lightning/torch/Hydra name the pack uses still exists in the installed versions.

That the pack uses no private name that ``_compat`` does not list, and imports them only there, is
checked in ``tests/test_claims.py``, with the package's other claims.
"""

import importlib

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
