"""Generate docs/API.md from the docstrings of the public names.

``python docs/gen_api.py`` writes the page; ``python docs/gen_api.py --check`` writes nothing, names
the sections that differ from the script's output and exits 1 if any does (``tests/test_api_docs.py``
runs the check). A section per name of ``ddp_plugins.core.__all__``, then of
``ddp_plugins.lightning.__all__`` and ``ddp_plugins.testing.__all__`` (case-insensitive order):
the signature line, the docstring's description (its ``Args:`` / ``Returns:`` / ``Raises:``
sections left out) and its ``Example::`` block as a doctest. A constant's description is its
``#:`` comment and its example is its value.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import torch

import ddp_plugins.core
import ddp_plugins.lightning
import ddp_plugins.testing

API = Path(__file__).resolve().parent / "API.md"

INTRO = """\
# API reference

Every public name of `ddp_plugins.core` (plain torch), `ddp_plugins.lightning` (the Lightning
adapters) and `ddp_plugins.testing` (the multi-process test harness); `ddp_plugins` re-exports the
most used ones. Each entry: where it lives, its signature,
what it does, and an example. This page is generated from the docstrings by `python docs/gen_api.py`:
edit the docstring, not the page. The tests (`tests/test_api_docs.py`) fail when the page differs
from the script's output or a public name has no example, and run every example, in order, after
this set-up:
"""

SETUP = """\
>>> import os, signal, sys, tempfile
>>> from pathlib import Path
>>> import torch
>>> from torch import nn
>>> from ddp_plugins.core import *
>>> from ddp_plugins.lightning import *
>>> from ddp_plugins.testing import *
"""

PACKAGES = (
    ("Core", ddp_plugins.core),
    ("Lightning adapters", ddp_plugins.lightning),
    ("Test harness", ddp_plugins.testing),
)


_SECTION = re.compile(r"^(Args|Arguments|Returns|Yields|Raises|Attributes):\s*$")
_EXAMPLE = re.compile(r"^Examples?::?\s*$")
_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):`~?([^`]+)`")
_HEADING = re.compile(r"^### `(\w+)`$", re.M)


def public_names() -> list[tuple[ModuleType, str]]:
    """``(package, name)`` for every section, in page order."""
    return [(package, name) for _, package in PACKAGES for name in sorted(package.__all__, key=str.lower)]


def signature_line(package: ModuleType, name: str) -> str:
    """Where ``name`` lives and how it is called.

    A class whose constructor Lightning defines gets no argument list (it varies with Lightning's
    version); an autograd function shows ``apply`` with its ``forward``'s arguments.
    """
    obj = getattr(package, name)
    if not callable(obj):
        return f"`{package.__name__}.{name}` = `{obj!r}`"
    path = f"{obj.__module__}.{obj.__qualname__}"
    if inspect.isclass(obj) and issubclass(obj, torch.autograd.Function):
        forward = inspect.signature(obj.forward)
        return f"`{path}.apply{forward.replace(parameters=list(forward.parameters.values())[1:])}`"
    if inspect.isclass(obj):
        owner = next(cls for cls in obj.__mro__ if "__init__" in vars(cls))
        if owner is not object and not owner.__module__.startswith("ddp_plugins"):
            return f"`{path}(...)`: the arguments of Lightning's `{owner.__qualname__}`"
    return f"`{path}{inspect.signature(obj)}`"


def split_docstring(doc: str) -> tuple[str, str]:
    """The description (without ``Args:``-like sections) and the dedented ``Example::`` block."""
    text: list[str] = []
    example: list[str] = []
    state = "text"
    for line in doc.splitlines():
        if state != "text" and line.strip() and not line.startswith(" "):
            state = "text"  # an unindented line ends a section or the example
        if state == "text":
            if _SECTION.match(line):
                state = "section"
            elif _EXAMPLE.match(line):
                state = "example"
            else:
                text.append(line)
        elif state == "example":
            example.append(line)
    description = re.sub(r"\n{3,}", "\n\n", "\n".join(text)).strip()
    return description, textwrap.dedent("\n".join(example)).strip()


def markdown(text: str) -> str:
    """Docstring markup as Markdown: roles and double backquotes as code spans, tags escaped."""
    text = _ROLE.sub(lambda m: f"``{m.group(1).rsplit('.', 1)[-1]}``", text)
    parts = re.split(r"(``.+?``|`[^`]+`)", text, flags=re.S)
    for i, part in enumerate(parts):
        if part.startswith("``") and "`" not in part[2:-2]:
            parts[i] = f"`{part[2:-2]}`"
        elif not part.startswith("`"):
            parts[i] = re.sub(r"<(?=[A-Za-z/])", r"\\<", part)
    return "".join(parts)


def constant_comment(package: ModuleType, name: str) -> str:
    """The ``#:`` comment above ``name``'s assignment in the module of ``package`` that defines it."""
    for path in sorted(Path(package.__file__ or "").parent.glob("*.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                lines = source.splitlines()[: node.lineno - 1]
                comment: list[str] = []
                while lines and lines[-1].startswith("#:"):
                    comment.insert(0, lines.pop()[2:].strip())
                return " ".join(comment)
    raise LookupError(f"{package.__name__}.{name}: no module-level assignment found")


def section(package: ModuleType, name: str) -> str:
    """The Markdown section of one public name."""
    obj = getattr(package, name)
    if callable(obj):
        description, example = split_docstring(inspect.getdoc(obj) or "")
    else:
        description, example = constant_comment(package, name), f">>> {name}\n{obj!r}"
    parts = [f"### `{name}`", signature_line(package, name), markdown(description)]
    if example:
        parts.append(f"```pycon\n{example}\n\n```")  # the blank line ends the doctest's expected output
    return "\n\n".join(part for part in parts if part) + "\n"


def render() -> str:
    """The whole page."""
    blocks = [INTRO, f"```pycon\n{SETUP}\n```\n"]
    for title, package in PACKAGES:
        blocks.append(f"## {title} (`{package.__name__}`)\n")
        blocks.extend(section(package, name) for p, name in public_names() if p is package)
    return "\n".join(blocks)


def sections(page: str) -> dict[str, str]:
    """``page`` cut at its ``### `name` `` headings; the text before the first is ``"(intro)"``."""
    parts = _HEADING.split(page)
    return {"(intro)": parts[0], **dict(zip(parts[1::2], parts[2::2], strict=True))}


def differences(page: str, fresh: str) -> list[str]:
    """The names of the sections (and ``"(intro)"``) in which ``page`` and ``fresh`` differ."""
    old, new = sections(page), sections(fresh)
    names = [*new, *(name for name in old if name not in new)]
    if list(old) != [name for name in names if name in old] and set(old) == set(new):
        return ["(order of the sections)"]
    return [name for name in names if old.get(name) != new.get(name)]


def main(argv: list[str]) -> int:
    fresh = render()
    if "--check" in argv:
        page = API.read_text() if API.exists() else ""
        differing = differences(page, fresh)
        for name in differing or (["(whole page)"] if page != fresh else []):
            print(f"docs/API.md: section {name} differs from the docstrings (run `python docs/gen_api.py`)")
        return 1 if page != fresh else 0
    API.write_text(fresh)
    print(f"docs/API.md: {len(public_names())} sections written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
