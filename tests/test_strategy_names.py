"""The strategy names resolve after ``import ddp_plugins``, whenever Lightning is imported (issue 52).

A Hydra trainer config writes ``strategy: ddp_plugins_spawn``; Lightning resolves it in a registry that
the strategy's module fills, and ``import ddp_plugins`` alone did not import that module: ``Trainer``
refused the name ("You selected an invalid strategy name") unless something imported the adapters.
``import ddp_plugins`` still imports no Lightning (the torch-only core), so each order is tried in a
fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

CHECK = """
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
names = sorted(n for n in StrategyRegistry.available_strategies() if n.startswith("ddp_plugins"))
assert names == ["ddp_plugins", "ddp_plugins_notebook", "ddp_plugins_spawn"], names
trainer = Trainer(strategy="ddp_plugins_spawn", accelerator="cpu", devices=2, logger=False)
print("resolved", type(trainer.strategy).__name__)
"""
ORDERS = {
    "ddp_plugins first": (
        "import importlib.util, sys\nimport ddp_plugins\n"
        "assert not any(m.split('.')[0] == 'lightning' for m in sys.modules), 'import ddp_plugins imported Lightning'\n"
        "assert importlib.util.find_spec('lightning.pytorch') is not None  # looked up first, imported after\n"
        "import lightning.pytorch\n"
    ),
    "lightning first": "import lightning.pytorch\nimport ddp_plugins\n",
    "an adapter's module": "import ddp_plugins.lightning.accumulation\n",  # its import imports Lightning
}


@pytest.mark.parametrize("order", ORDERS)
def test_the_strategy_names_resolve_after_import_ddp_plugins(order):
    done = subprocess.run(
        [sys.executable, "-c", ORDERS[order] + CHECK], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resolved DDPPluginsStrategy" in done.stdout
    assert "not registered" not in done.stderr, done.stderr[-3000:]
