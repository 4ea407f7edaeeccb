"""docs/design.md's layout of the package is the package's (issue 52: five modules were missing from it).

Every module a package of the layout names exists, and every public module of those packages is named
(a private module, ``_name``, is the package's own business).
"""

from __future__ import annotations

import re

from tests.helpers import REPO_ROOT

DESIGN = REPO_ROOT / "docs" / "design.md"


def _layout() -> dict[str, set[str]]:
    """The layout block's packages and the modules named under each (``a / b`` names two)."""
    block = DESIGN.read_text().split("```\nddp_plugins.core", 1)[1].split("```", 1)[0]
    named: dict[str, set[str]] = {}
    package = "ddp_plugins.core"
    for line in ("ddp_plugins.core" + block).splitlines():
        if line.startswith("ddp_plugins."):
            package = line.split()[0]
            named.setdefault(package, set())
        elif line.startswith("    ") and line.strip():
            names = re.match(r"\s+([\w/ ]+?)\s{2,}", line)
            assert names, f"a layout line without a module name: {line!r}"
            named[package] |= {name.strip() for name in names.group(1).split("/")}
    return named


def test_the_design_layout_names_each_module_of_the_package_and_no_other():
    for package, modules in _layout().items():
        folder = REPO_ROOT.joinpath(*package.split("."))
        if not folder.is_dir():
            continue  # a module of the top level (testing, _compat): it names no modules under it
        present = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
        present |= {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
        assert modules - present == set(), f"{package}: docs/design.md names modules that are gone: {modules - present}"
        assert present - modules == set(), f"{package}: modules docs/design.md does not name: {present - modules}"
