"""Every private Lightning/torch name the pack uses still exists in the installed versions."""

import importlib

import lightning
import pytest
import torch

from ddp_plugins import _compat


@pytest.mark.parametrize(("module", "path"), _compat.CHECKED, ids=[f"{m}:{p}" for m, p in _compat.CHECKED])
def test_private_name_still_exists(module, path):
    try:
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        pytest.fail(
            f"{module}.{path} is gone in torch {torch.__version__} / lightning {lightning.__version__} ({err});"
            " ddp_plugins/_compat.py names the versions it was checked against: update it there."
        )
    assert callable(obj), f"{module}.{path} is no longer callable"


def test_no_private_lightning_or_torch_import_outside_compat():
    """Private names are imported only in _compat (the launchers subclass through it)."""
    import pathlib
    import re

    package = pathlib.Path(_compat.__file__).parent
    pattern = re.compile(r"^\s*from (lightning|torch|pytorch_lightning)\S* import .*\b_[A-Za-z]\w*", re.M)
    offenders = [
        f"{path.relative_to(package.parent)}: {match.group(0).strip()}"
        for path in package.rglob("*.py")
        if path.name != "_compat.py"
        for match in pattern.finditer(path.read_text())
    ]
    assert offenders == [], "private imports outside _compat: " + "; ".join(offenders)


def test_compat_accessors_work_on_a_strategy():
    from lightning.pytorch.strategies import DDPStrategy

    def hook(state, bucket):
        return bucket

    strategy = DDPStrategy(ddp_comm_hook=hook, ddp_comm_state="state")
    assert _compat.strategy_comm_hook(strategy) is hook
    assert _compat.strategy_comm_state_and_wrapper(strategy) == ("state", None)
    _compat.set_strategy_comm_hook(strategy, None)
    assert _compat.strategy_comm_hook(strategy) is None
