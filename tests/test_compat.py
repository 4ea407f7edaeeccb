"""Every private Lightning/torch/Hydra name the pack uses still exists in the installed versions."""

import ast
import importlib
import inspect
import pathlib
import re

import hydra
import lightning
import pytest
import torch

from ddp_plugins import _compat

_PACKAGE = pathlib.Path(_compat.__file__).parent
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


def test_accelerator_connector_still_takes_plugins():
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    assert "plugins" in _AcceleratorConnector.__init__.__code__.co_varnames, (
        f"_AcceleratorConnector.__init__ has no `plugins` local in {_VERSIONS}, which"
        f" _compat.explicit_trainer_plugins reads; {_UPDATE}"
    )


_THIRD_PARTY = ("lightning", "pytorch_lightning", "torch", "hydra")
_IMPORT = re.compile(
    r"^\s*(?:from\s+(?P<module>[\w.]+)\s+import\s+(?P<names>\([^)]*\)|[^\n]*)|import\s+(?P<imported>[\w., ]+))",
    re.M,
)


def test_no_private_third_party_import_outside_compat():
    """Private modules and names of Lightning, torch and Hydra are imported only in _compat."""
    offenders = []
    for path in _PACKAGE.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for match in _IMPORT.finditer(path.read_text()):
            modules = (
                [match["module"]] if match["module"] else [m.split(" as ")[0] for m in match["imported"].split(",")]
            )
            names = re.findall(r"\b(\w+)(?:\s+as\s+\w+)?", match["names"] or "")
            for module in (m.strip() for m in modules):
                if module.split(".")[0] not in _THIRD_PARTY:
                    continue
                if any(part.startswith("_") for part in module.split(".")) or any(n.startswith("_") for n in names):
                    offenders.append(f"{path.relative_to(_PACKAGE.parent)}: {' '.join(match.group(0).split())}")
    assert offenders == [], "private imports outside _compat: " + "; ".join(offenders)


def _listed():
    """(class, attribute) pairs that _compat lists."""
    listed = []
    for module, path in _compat.CHECKED:
        owner, _, attr = path.rpartition(".")
        if owner:
            listed.append((_resolve(module, owner), attr))
    for module, name, attributes in _compat.CHECKED_ATTRIBUTES:
        listed += [(_resolve(module, name), attr) for attr in attributes]
    return listed


def _private_names_set_in(cls):
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"self\.(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=[^=]", source))


def test_inherited_private_names_are_listed_in_compat():
    """What a subclass of a Lightning/torch/Hydra class uses or overrides of its private names is in _compat."""
    listed = _listed()
    unlisted = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        module = importlib.import_module(".".join(path.relative_to(_PACKAGE.parent).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if not inspect.isclass(cls):
                continue
            bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in _THIRD_PARTY]
            used = {
                sub.attr
                for sub in ast.walk(node)
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self"
            } | {sub.name for sub in ast.walk(node) if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for attr in sorted(a for a in used if a.startswith("_") and not a.startswith("__")):
                inherited = any(attr in vars(b) or attr in _private_names_set_in(b) for b in bases)
                if inherited and not any(issubclass(cls, owner) and attr == name for owner, name in listed):
                    unlisted.append(f"{cls.__module__}.{cls.__name__}.{attr}")
    assert unlisted == [], (
        "private names inherited from Lightning/torch/Hydra, not listed in _compat.CHECKED or"
        " CHECKED_ATTRIBUTES: " + ", ".join(unlisted)
    )


def test_compat_accessors_work_on_a_strategy():
    from lightning.pytorch.strategies import DDPStrategy

    def hook(state, bucket):
        return bucket

    strategy = DDPStrategy(ddp_comm_hook=hook, ddp_comm_state="state")
    assert _compat.strategy_comm_hook(strategy) is hook
    assert _compat.strategy_comm_state_and_wrapper(strategy) == ("state", None)
    _compat.set_strategy_comm_hook(strategy, None)
    assert _compat.strategy_comm_hook(strategy) is None
