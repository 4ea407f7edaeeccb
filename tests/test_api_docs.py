"""docs/API.md is generated from the docstrings, lists every public name with an example, and its examples run."""

import doctest
import re
import runpy

import ddp_plugins
import ddp_plugins.core
import ddp_plugins.lightning
import ddp_plugins.testing
from tests.helpers import REPO_ROOT

API = REPO_ROOT / "docs" / "API.md"


def _sections() -> dict[str, str]:
    parts = re.split(r"^### `(\w+)`$", API.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_public_name_has_a_section_with_an_example():
    sections = _sections()
    packages = (ddp_plugins, ddp_plugins.core, ddp_plugins.lightning, ddp_plugins.testing)
    public = {name for package in packages for name in package.__all__}
    missing = sorted(public - set(sections))
    assert missing == [], f"public names missing from docs/API.md: {missing}"
    without_example = sorted(name for name in public if ">>> " not in sections[name])
    assert without_example == [], f"docs/API.md sections without an example: {without_example}"
    stale = sorted(set(sections) - public)
    assert stale == [], f"docs/API.md documents names that are not public: {stale}"


def test_the_examples_run():
    failures, tried = doctest.testfile(str(API), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert tried > 40 and failures == 0, f"{failures} of {tried} examples in docs/API.md failed"


def test_the_page_is_the_generator_s_output():
    script = runpy.run_path(str(REPO_ROOT / "docs" / "gen_api.py"))
    page, fresh = API.read_text(), script["render"]()
    differing = script["differences"](page, fresh)
    assert page == fresh, f"docs/API.md differs from `python docs/gen_api.py` in: {differing}; run it"
    assert "object at 0x" not in page


def test_the_readme_links_the_api_reference():
    assert "docs/API.md" in (REPO_ROOT / "README.md").read_text()
