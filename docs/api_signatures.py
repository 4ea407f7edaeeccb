"""Keep the signature line of every section of docs/API.md equal to the code.

``python docs/api_signatures.py`` rewrites each section's signature line (the line after its
``### `name` `` heading that starts with a backquote) from ``inspect.signature`` of the public
name; ``--check`` only reports the lines that differ and exits 1 (``tests/test_api_docs.py`` runs
the check). Constants get ``module.NAME`` = ``repr``; a class whose ``__init__`` is Lightning's keeps its
line (it varies with Lightning's version). Descriptions and examples are written by hand.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import ddp_plugins.core
import ddp_plugins.lightning

API = Path(__file__).resolve().parent / "API.md"
HEADING = re.compile(r"^### `(\w+)`$")


def signature_line(name: str) -> str:
    """The signature line of public name ``name`` (core first, then the Lightning adapters)."""
    package = ddp_plugins.core if name in ddp_plugins.core.__all__ else ddp_plugins.lightning
    obj = getattr(package, name)
    if callable(obj):
        return f"`{obj.__module__}.{obj.__qualname__}{inspect.signature(obj)}`"
    return f"`{package.__name__}.{name}` = `{obj!r}`"


def _ours(name: str) -> bool:
    package = ddp_plugins.core if name in ddp_plugins.core.__all__ else ddp_plugins.lightning
    obj = getattr(package, name)
    target = obj.__init__ if inspect.isclass(obj) else obj
    return not callable(obj) or getattr(target, "__module__", "").startswith("ddp_plugins")


def updated(text: str) -> tuple[str, list[str]]:
    """``text`` with every signature line regenerated, and the names whose line changed."""
    lines, changed, name = text.split("\n"), [], None
    for i, line in enumerate(lines):
        heading = HEADING.match(line)
        if heading:
            name = heading.group(1)
        elif name is not None and line.startswith("`"):
            if not _ours(name):  # a signature Lightning defines varies with its version
                name = None
                continue
            fresh = signature_line(name)
            if fresh != line:
                lines[i], changed = fresh, [*changed, name]
            name = None
    return "\n".join(lines), changed


def main() -> int:
    text, changed = updated(API.read_text())
    if "--check" in sys.argv:
        for name in changed:
            print(f"docs/API.md: the signature of {name} differs from the code: {signature_line(name)}")
        return 1 if changed else 0
    API.write_text(text)
    print(f"docs/API.md: {len(changed)} signature lines rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
