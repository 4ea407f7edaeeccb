"""The claims the docs make about the code, kept by the code.

- one version: ``pyproject.toml``, ``ddp_plugins.__version__`` and the CHANGELOG's newest entry;
- the declared torch floor is the torch CI tests (``requirements.lock``); Lightning's floor is what
  ``make matrix`` installs (the Makefile reads it from ``pyproject.toml``);
- the core (``ddp_plugins.core``) imports and names no layer above it: not the adapters, the app,
  Lightning, torchmetrics or Hydra (docstrings may mention them), by absolute or relative import, by
  a name the package re-exports, or through an imported module's attribute;
- no module imports another module's private (``_``) names, nor a private module of a third party,
  ``_compat`` aside;
- no private name is reached through a module (``collectives._flatten``, ``dist._x``) outside ``_compat``;
- a private attribute is read or set only on the object's own ``self``/``cls``/``super()``; on any
  other object only inside ``ddp_plugins/_compat.py`` (whose members ``tests/test_compat.py`` checks
  against the installed versions), or where it is the pack's own object (``OWN_OBJECTS``, below). The
  receiver's type cannot be read from the source, so no name is excused elsewhere: ``_timeout``
  listed for the strategy would excuse ``trainer.fit_loop._timeout`` too (issue 52);
- what a subclass of a Lightning/torch/Hydra class uses or overrides of its private names is listed
  in ``_compat``;
- the callbacks (every adapter but the strategy) know the strategy only through the contracts: none
  imports ``DDPPluginsStrategy`` or the strategy's or the launchers' module, by any spelling.

Each checker takes the package folder, so a test plants a violation in a copy under ``tmp_path``
and sees it reported (the ``*_catches_a_planted_violation`` tests).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import tomllib

import ddp_plugins
from ddp_plugins import _compat
from tests.helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "ddp_plugins"
COMPAT = "_compat.py"
UPPER = ("ddp_plugins.lightning", "ddp_plugins.app", "lightning", "torchmetrics", "hydra", "omegaconf")
THIRD_PARTY_BASES = ("lightning", "pytorch_lightning", "torch", "hydra")
# namedtuple's public API, which starts with an underscore so as not to clash with field names
NAMEDTUPLE = {"_asdict", "_replace", "_fields", "_make", "_field_defaults"}
# Private-looking names of the standard library that its docs define as public API.
DOCUMENTED = {
    "os._exit": "os docs: exit without cleanup, for a child process or a process that must not hang",
    "sys._current_frames": "sys docs: every thread's frame, for the stack dump of a stalled rank",
}
# (file, module.name): a private name reached through a module outside _compat that the pack still
# has, each a known violation with the issue that removes it. Remove the entry with the use.
MODULE_PRIVATE_KNOWN: dict[tuple[str, str], str] = {}
# (file, attribute): a private attribute read on an object that is not `self` but is the pack's own.
OWN_OBJECTS = {
    ("ddp_plugins/core/timeline.py", "_start"): "its own Timeline: TimedCommHook and collective_kind call it",
    ("ddp_plugins/core/timeline.py", "_end"): "its own Timeline: TimedCommHook and collective_kind call it",
}
STRATEGY_MODULES = ("ddp_plugins.lightning.strategy", "ddp_plugins.lightning.launchers")
STRATEGY_OWNERS = {"strategy.py": "the strategy itself", "__init__.py": "the package's re-exports"}


# -- reading the package ---------------------------------------------------------------------------


def _modules(folder: Path = PACKAGE) -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(folder.rglob("*.py"))]


def _where(path: Path, package: Path, node: ast.AST) -> str:
    return f"{path.relative_to(package.parent).as_posix()}:{node.lineno}"


def _in_order(offences: list[str]) -> list[str]:
    """Each offence once, by file and line."""

    def key(offence: str) -> tuple[str, int, str]:
        file, line, what = offence.split(":", 2)
        return file, int(line), what

    return sorted(set(offences), key=key)


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


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _from_module(node: ast.ImportFrom, path: Path, package: Path) -> str:
    """The absolute module of ``from <module> import ...``, relative imports resolved."""
    if not node.level:
        return node.module or ""
    parts = _module_name(path, package).split(".")
    if path.name != "__init__.py":
        parts = parts[:-1]  # the module's package
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(tree: ast.Module, path: Path, package: Path) -> Iterator[tuple[ast.stmt, str, str | None, str]]:
    """(node, module, imported name or None, the local name bound) for every import of the file."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, None, alias.asname or alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(node, path, package)
            for alias in node.names:
                yield node, module, alias.name, alias.asname or alias.name


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, AttributeError, ValueError):
        return False


def _origin(module: str, name: str) -> str | None:
    """The module ``module.name`` is, or defines it (``ddp_plugins.DDPPluginsStrategy`` is
    ``ddp_plugins.lightning.strategy``); only for the package's own modules, which re-export."""
    if module.split(".")[0] != "ddp_plugins":
        return None
    if _is_module(f"{module}.{name}"):
        return f"{module}.{name}"
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)


def _imported_names(module: str, name: str | None) -> set[str]:
    """What an import can be said to name: the module, ``module.name`` and where that comes from."""
    if name is None:
        return {module}
    return {module, f"{module}.{name}", _origin(module, name) or module}


def _module_bindings(tree: ast.Module, path: Path, package: Path) -> dict[str, str]:
    """Local name -> the module it is bound to (``import x.y as z``, ``import x.y``, ``from pkg import mod``)."""
    bound = {}
    for _, module, name, local in _imports(tree, path, package):
        if name is None:
            bound[local] = module if local != module.split(".")[0] else local  # `import x.y as z` or `import x`
        elif name != "*" and _is_module(f"{module}.{name}"):
            bound[local] = f"{module}.{name}"
    return bound


def _dotted(node: ast.expr) -> tuple[str, list[str]] | None:
    """``a.b.c`` as ("a", ["b", "c"]); None when the chain does not start at a plain name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.insert(0, node.attr)
        node = node.value
    return (node.id, attrs) if isinstance(node, ast.Name) else None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_own(receiver: ast.expr) -> bool:
    """``self``, ``cls``, ``super()`` and ``type(self)``: the object's own attributes."""
    if isinstance(receiver, ast.Name):
        return receiver.id in ("self", "cls")
    if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name):
        return receiver.func.id == "super" or (
            receiver.func.id == "type" and len(receiver.args) == 1 and _is_own(receiver.args[0])
        )
    return False


# -- the checkers: each returns "file:line: what" for every violation under `package` ---------------


def core_layer_offences(package: Path = PACKAGE) -> list[str]:
    """Names of a layer above the core, in ``<package>/core``."""
    offences = []
    for path, tree in _modules(package / "core"):
        docstrings = _docstrings(tree)
        modules = _module_bindings(tree, path, package)
        named: list[tuple[ast.AST, set[str]]] = [
            (node, _imported_names(module, name)) for node, module, name, _ in _imports(tree, path, package)
        ]
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                named.append((node, set(re.findall(r"[A-Za-z_][\w.]*", node.value))))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                chain = _dotted(node)
                if chain and chain[0] in modules:
                    module = ".".join([modules[chain[0]], *chain[1][:-1]])
                    named.append((node, _imported_names(module, chain[1][-1])))
        for node, names in named:
            for name in sorted(n for n in names if any(n == up or n.startswith(up + ".") for up in UPPER)):
                offences.append(f"{_where(path, package, node)}: {name}")
    return _in_order(offences)


def private_import_offences(package: Path = PACKAGE) -> list[str]:
    """Imports of another module's private names, or of a third party's private module, outside _compat."""
    offences = []
    own = package.name
    for path, tree in _modules(package):
        if path.name == COMPAT:
            continue
        for node, module, name, _ in _imports(tree, path, package):
            third_party = module.split(".")[0] != own
            private_module = third_party and any(_is_private(part) for part in module.split("."))
            private_name = name is not None and _is_private(name) and f"{module}.{name}" != f"{own}._compat"
            if private_module or private_name:
                offences.append(f"{_where(path, package, node)}: {module}{'' if name is None else ' import ' + name}")
    return _in_order(offences)


def module_private_offences(package: Path = PACKAGE) -> list[str]:
    """Private names reached through an imported module (``collectives._flatten``), outside _compat."""
    offences = []
    for path, tree in _modules(package):
        if path.name == COMPAT:
            continue
        modules = _module_bindings(tree, path, package)
        relative = path.relative_to(package.parent).as_posix()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            chain = _dotted(node)
            if chain is None or chain[0] not in modules:
                continue
            name = ".".join([modules[chain[0]], *chain[1]])
            if name not in DOCUMENTED and (relative, name) not in MODULE_PRIVATE_KNOWN:
                offences.append(f"{_where(path, package, node)}: {name}")
    return _in_order(offences)


def foreign_private_offences(package: Path = PACKAGE) -> list[str]:
    """Private attributes read or set on an object that is not ``self`` (``trainer._world``) and not the
    pack's own object (``OWN_OBJECTS``), outside _compat (a namedtuple's ``_replace`` is its public API)."""
    offences = []
    for path, tree in _modules(package):
        if path.name == COMPAT:
            continue
        modules = _module_bindings(tree, path, package)
        relative = path.relative_to(package.parent).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                receiver, attribute = node.value, node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _is_private(node.args[1].value)
            ):
                receiver, attribute = node.args[0], node.args[1].value
            else:
                continue
            chain = _dotted(receiver)
            through_module = chain is not None and chain[0] in modules  # module_private_offences' case
            if _is_own(receiver) or through_module or attribute in NAMEDTUPLE or (relative, attribute) in OWN_OBJECTS:
                continue
            offences.append(f"{_where(path, package, node)}: {ast.unparse(receiver)}.{attribute}")
    return _in_order(offences)


def callback_strategy_offences(package: Path = PACKAGE) -> list[str]:
    """Imports or names of the strategy (``DDPPluginsStrategy``, its module, the launchers' module) in
    the Lightning adapters other than the strategy."""
    offences = []
    for path, tree in _modules(package / "lightning"):
        if path.name in STRATEGY_OWNERS:
            continue
        docstrings = _docstrings(tree)
        found: list[tuple[ast.AST, str]] = []
        for node, module, name, _ in _imports(tree, path, package):
            names = _imported_names(module, name)
            if name == "DDPPluginsStrategy" or any(n.startswith(STRATEGY_MODULES) for n in names):
                found.append((node, f"{module}{'' if name is None else ' import ' + name}"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Name) and node.id == "DDPPluginsStrategy") or (
                isinstance(node, ast.Attribute) and node.attr == "DDPPluginsStrategy"
            ):
                found.append((node, ast.unparse(node)))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                found += [(node, repr(node.value)) for module in STRATEGY_MODULES if module in node.value]
        offences += [f"{_where(path, package, node)}: {what}" for node, what in found]
    return _in_order(offences)


def _private_names_set_in(cls: type) -> set[str]:
    """The private attributes a class's own source assigns to ``self``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return set()
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            continue
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return {name for name in names if _is_private(name)}


def _listed_pairs() -> list[tuple[type, str]]:
    """(class, attribute) pairs that _compat lists."""

    def resolve(module: str, path: str) -> object:
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    listed = []
    for module, path in _compat.CHECKED:
        owner, _, attr = path.rpartition(".")
        if owner:
            listed.append((resolve(module, owner), attr))
    for module, name, attributes in _compat.CHECKED_ATTRIBUTES:
        listed += [(resolve(module, name), attr) for attr in attributes]
    return listed


def inherited_private_offences(package: Path = PACKAGE) -> list[str]:
    """What a subclass of a Lightning/torch/Hydra class uses or overrides of its private names, not
    listed in _compat (the package is imported: its folder's parent must be on ``sys.path``)."""
    listed = _listed_pairs()
    unlisted = []
    for path, tree in _modules(package):
        if path.name == COMPAT:
            continue
        module = importlib.import_module(_module_name(path, package))
        for node in ast.walk(tree):
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if not inspect.isclass(cls):
                continue
            bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in THIRD_PARTY_BASES]
            subs = list(ast.walk(node))
            used = {sub.attr for sub in subs if isinstance(sub, ast.Attribute) and _is_own(sub.value)}
            used |= {sub.name for sub in subs if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for attr in sorted(a for a in used if _is_private(a)):
                inherited = any(attr in vars(b) or attr in _private_names_set_in(b) for b in bases)
                if inherited and not any(issubclass(cls, owner) and attr == name for owner, name in listed):
                    unlisted.append(f"{cls.__module__}.{cls.__name__}.{attr}")
    return unlisted


# -- the claims, on the package --------------------------------------------------------------------


def test_one_version_everywhere():
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    newest = re.search(r"^## \[([^\]]+)\]", (REPO_ROOT / "CHANGELOG.md").read_text(), re.MULTILINE).group(1)
    assert declared == ddp_plugins.__version__ == newest, (declared, ddp_plugins.__version__, newest)


def test_the_declared_torch_range_is_the_tested_range():
    """pyproject's torch range: its floor is what `make matrix` installs and `_compat` refuses below, its cap is
    just above the newest torch `make matrix` installs; the lock's torch (`make test`) lies inside."""
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = next(d for d in dependencies if d.startswith("torch>="))
    floor, cap = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", declared).groups()
    makefile = (REPO_ROOT / "Makefile").read_text()
    tested = dict(re.findall(r"^TORCH_(FLOOR|NEWEST) := ([\d.]+)$", makefile, re.MULTILINE))
    locked = re.search(r"^torch==([\d.]+)", (REPO_ROOT / "requirements.lock").read_text(), re.MULTILINE).group(1)
    floor_v, cap_v, newest_v, locked_v = (tuple(map(int, v.split("."))) for v in (floor, cap, tested["NEWEST"], locked))
    assert tuple(map(int, tested["FLOOR"].split(".")))[:2] == floor_v == _compat.TORCH_FLOOR, (floor, tested)
    assert newest_v[:2] == (cap_v[0], cap_v[1] - 1), f"the cap {cap} should sit just above the newest tested {newest_v}"
    assert floor_v <= locked_v[:2] < cap_v, (declared, locked)


def test_the_core_imports_and_names_no_layer_above_it():
    offences = core_layer_offences()
    assert offences == [], "the core names layers above it:\n" + "\n".join(offences)


def test_no_private_import_outside_compat():
    offences = private_import_offences()
    assert offences == [], "private names or third-party private modules imported outside _compat:\n" + "\n".join(
        offences
    )


def test_no_private_name_is_reached_through_a_module_outside_compat():
    offences = module_private_offences()
    assert offences == [], "private names reached through a module outside _compat:\n" + "\n".join(offences)


def test_every_private_attribute_of_another_object_is_reached_in_compat():
    offences = foreign_private_offences()
    assert offences == [], (
        "private attributes of objects other than self, outside _compat (nor OWN_OBJECTS):\n" + "\n".join(offences)
    )


def test_inherited_private_names_are_listed_in_compat():
    unlisted = inherited_private_offences()
    assert unlisted == [], (
        "private names inherited from Lightning/torch/Hydra, not listed in _compat.CHECKED or"
        " CHECKED_ATTRIBUTES: " + ", ".join(unlisted)
    )


def test_the_callbacks_know_the_strategy_only_through_the_contracts():
    """contracts.py's claim: no adapter but the strategy (and the package's own re-exports) imports
    the strategy or the strategy's or the launchers' module."""
    offences = callback_strategy_offences()
    assert offences == [], "adapters that know the strategy other than through the contracts:\n" + "\n".join(offences)


def test_the_allow_lists_name_what_is_still_there():
    """An allow-list entry whose use is gone is removed, so that a new use is caught."""
    stale = []
    for (relative, name), _ in [*MODULE_PRIVATE_KNOWN.items(), *OWN_OBJECTS.items()]:
        path = PACKAGE.parent / relative
        if not path.exists() or name.rpartition(".")[2] not in path.read_text():
            stale.append(f"{relative}: {name}")
    assert stale == [], "allow-list entries whose use is gone (remove them): " + ", ".join(stale)


# -- each checker catches a violation planted in a copy ----------------------------------------------


def _plant(tmp_path: Path, relative: str, source: str, name: str = "ddp_plugins") -> Path:
    """A package folder ``<tmp_path>/<name>`` holding one module, ``relative``; returns the folder."""
    path = tmp_path / name / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    for folder in [path.parent, *path.parent.parents]:
        if folder == tmp_path:
            break
        (folder / "__init__.py").touch()
    path.write_text(textwrap.dedent(source))
    return tmp_path / name


def test_core_layer_check_catches_a_planted_violation(tmp_path):
    package = _plant(
        tmp_path,
        "core/bad.py",
        """
        from .. import lightning
        from ..app import config
        from ddp_plugins import DDPPluginsStrategy
        import ddp_plugins

        def f():
            return ddp_plugins.lightning
        """,
    )
    assert core_layer_offences(package) == [
        "ddp_plugins/core/bad.py:2: ddp_plugins.lightning",
        "ddp_plugins/core/bad.py:3: ddp_plugins.app",
        "ddp_plugins/core/bad.py:3: ddp_plugins.app.config",
        "ddp_plugins/core/bad.py:4: ddp_plugins.lightning.strategy",
        "ddp_plugins/core/bad.py:8: ddp_plugins.lightning",
    ]


def test_private_import_check_catches_a_planted_violation(tmp_path):
    package = _plant(
        tmp_path,
        "lightning/bad.py",
        """
        from __future__ import annotations
        import torch._C
        from torch.nn.modules._functions import SyncBatchNorm
        from ddp_plugins.core.collectives import _flatten
        from ddp_plugins import _compat
        """,
    )
    assert private_import_offences(package) == [
        "ddp_plugins/lightning/bad.py:3: torch._C",
        "ddp_plugins/lightning/bad.py:4: torch.nn.modules._functions import SyncBatchNorm",
        "ddp_plugins/lightning/bad.py:5: ddp_plugins.core.collectives import _flatten",
    ]


def test_module_private_check_catches_a_planted_violation(tmp_path):
    package = _plant(
        tmp_path,
        "lightning/bad.py",
        """
        import sys
        import torch.distributed as dist
        from ddp_plugins.core import collectives
        from . import network

        def f(x):
            collectives._flatten(x)
            dist.distributed_c10d._get_default_store()
            network._private
            sys._getframe(1)
            return sys._current_frames()
        """,
    )
    assert module_private_offences(package) == [
        "ddp_plugins/lightning/bad.py:8: ddp_plugins.core.collectives._flatten",
        "ddp_plugins/lightning/bad.py:9: torch.distributed.distributed_c10d._get_default_store",
        "ddp_plugins/lightning/bad.py:10: ddp_plugins.lightning.network._private",
        "ddp_plugins/lightning/bad.py:11: sys._getframe",
    ]


def test_foreign_private_check_catches_a_planted_violation(tmp_path):
    # `_world` and `_trainer` are names the pack may assign on its own `self`: read on a Lightning
    # object they are still a third party's private attributes; `_timeout` and `_experiment` are names
    # _compat reaches on other owners (the strategy, a logger class): outside it, excused on none
    package = _plant(
        tmp_path,
        "lightning/bad.py",
        """
        class Watcher:
            def __init__(self, trainer):
                self._trainer = trainer
                self._world = 2

            def setup(self, trainer, pl_module):
                pl_module._trainer = trainer
                getattr(trainer.strategy, "_world", None)
                return trainer.strategy._timeout, self._trainer, type(self)._world, super()._x

            def teardown(self, trainer, logger):
                return trainer.fit_loop._timeout, logger._experiment, self._world._replace(x=1)
        """,
    )
    assert foreign_private_offences(package) == [
        "ddp_plugins/lightning/bad.py:8: pl_module._trainer",
        "ddp_plugins/lightning/bad.py:9: trainer.strategy._world",
        "ddp_plugins/lightning/bad.py:10: trainer.strategy._timeout",
        "ddp_plugins/lightning/bad.py:13: logger._experiment",
        "ddp_plugins/lightning/bad.py:13: trainer.fit_loop._timeout",
    ]


def test_callback_strategy_check_catches_a_planted_violation(tmp_path):
    package = _plant(
        tmp_path,
        "lightning/bad.py",
        """
        from typing import TYPE_CHECKING
        import ddp_plugins
        from ddp_plugins import DDPPluginsStrategy
        from ddp_plugins.lightning import strategy
        from . import launchers
        from .strategy import something
        import ddp_plugins.lightning.strategy
        if TYPE_CHECKING:
            from ddp_plugins.lightning import DDPPluginsStrategy as S

        def f(trainer):
            return isinstance(trainer.strategy, ddp_plugins.DDPPluginsStrategy)
        """,
    )
    assert callback_strategy_offences(package) == [
        "ddp_plugins/lightning/bad.py:4: ddp_plugins import DDPPluginsStrategy",
        "ddp_plugins/lightning/bad.py:5: ddp_plugins.lightning import strategy",
        "ddp_plugins/lightning/bad.py:6: ddp_plugins.lightning import launchers",
        "ddp_plugins/lightning/bad.py:7: ddp_plugins.lightning.strategy import something",
        "ddp_plugins/lightning/bad.py:8: ddp_plugins.lightning.strategy",
        "ddp_plugins/lightning/bad.py:10: ddp_plugins.lightning import DDPPluginsStrategy",
        "ddp_plugins/lightning/bad.py:13: ddp_plugins.DDPPluginsStrategy",
    ]


def test_inherited_private_check_catches_a_planted_violation(tmp_path, monkeypatch):
    package = _plant(
        tmp_path,
        "bad.py",
        """
        from lightning.pytorch.strategies import DDPStrategy

        class Strategy(DDPStrategy):
            def _get_process_group_backend(self):
                return super()._get_process_group_backend()

            def setup_distributed(self):
                self._process_group_backend = "gloo"
                return self._start_method
        """,
        name="planted_inherited",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert inherited_private_offences(package) == ["planted_inherited.bad.Strategy._process_group_backend"]
    finally:
        for module in [m for m in sys.modules if m.split(".")[0] == "planted_inherited"]:
            del sys.modules[module]
