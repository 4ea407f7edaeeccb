"""The claims the docs make about the code, kept by the code.

- one version: ``pyproject.toml``, ``ddp_plugins.__version__`` and the CHANGELOG's newest entry;
- the declared torch floor is the torch CI tests (``requirements.lock``); Lightning's floor is what
  ``make matrix`` installs (the Makefile reads it from ``pyproject.toml``);
- the core (``ddp_plugins.core``) imports and names no layer above it: not the adapters, the app,
  Lightning, torchmetrics or Hydra (docstrings may mention them);
- no module of the package imports another module's private (``_``) names, ``_compat`` aside;
- every private name of torch, Lightning or Hydra the package reads is listed in
  ``ddp_plugins/_compat.py`` (which ``tests/test_compat.py`` checks against the installed versions),
  and private names are imported from third-party modules only there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

import ddp_plugins
from ddp_plugins import _compat
from tests.helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "ddp_plugins"
UPPER = ("ddp_plugins.lightning", "ddp_plugins.app", "lightning", "torchmetrics", "hydra", "omegaconf")
# namedtuple's API, and CPython's frame introspection (documented in the sys module's docs)
ALLOWED_PRIVATE = {"_asdict", "_replace", "_fields", "_make", "_getframe", "_current_frames"}


def _modules(folder: Path = PACKAGE) -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(folder.rglob("*.py"))]


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.add(id(value))
    return found


def test_one_version_everywhere():
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    newest = re.search(r"^## \[([^\]]+)\]", (REPO_ROOT / "CHANGELOG.md").read_text(), re.MULTILINE).group(1)
    assert declared == ddp_plugins.__version__ == newest, (declared, ddp_plugins.__version__, newest)


def test_the_declared_torch_floor_is_the_tested_torch():
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(re.match(r"torch>=([\d.]+)", d).group(1) for d in dependencies if d.startswith("torch>="))
    tested = re.search(r"^torch==([\d.]+)", (REPO_ROOT / "requirements.lock").read_text(), re.MULTILINE).group(1)
    assert tuple(map(int, floor.split("."))) == tuple(map(int, tested.split(".")))[: len(floor.split("."))], (
        f"pyproject.toml allows torch>={floor}, but CI tests torch {tested} only"
    )


def test_the_core_imports_and_names_no_layer_above_it():
    offences = []
    for path, tree in _modules(PACKAGE / "core"):
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                names = re.findall(r"[A-Za-z_][\w.]*", node.value)
            for name in names:
                if any(name == upper or name.startswith(upper + ".") for upper in UPPER):
                    offences.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {name}")
    assert offences == [], "the core names layers above it:\n" + "\n".join(offences)


def test_no_module_imports_another_modules_private_names():
    offences = [
        f"{path.relative_to(REPO_ROOT)}:{node.lineno}: from {node.module} import {alias.name}"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__") and alias.name != "_compat"
        if path.name != "_compat.py" or node.module.startswith("ddp_plugins")
    ]
    assert offences == [], "private names imported across modules:\n" + "\n".join(offences)


def test_every_private_third_party_name_read_is_listed_in_compat():
    defined, read = set(), {}
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if path.name != "_compat.py":
                    read.setdefault(node.attr, f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    listed = {name.split(".")[-1] for _, name in _compat.CHECKED}
    listed |= {attribute for _, _, attributes in _compat.CHECKED_ATTRIBUTES for attribute in attributes}
    unlisted = {name: where for name, where in read.items() if name not in defined | listed | ALLOWED_PRIVATE}
    assert unlisted == {}, f"private names read outside _compat and not listed there: {unlisted}"


def test_the_callbacks_know_the_strategy_only_through_the_contracts():
    """contracts.py's claim: no adapter but the strategy (and the package's own re-exports) imports
    the strategy's or the launchers' module."""
    owners = {"strategy.py", "__init__.py"}
    offences = [
        f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {node.module}"
        for path, tree in _modules(PACKAGE / "lightning")
        if path.name not in owners
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module in ("ddp_plugins.lightning.strategy", "ddp_plugins.lightning.launchers")
    ]
    assert offences == [], offences
