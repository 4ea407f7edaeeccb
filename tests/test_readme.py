"""The README keeps its promises: its first example runs as written, and every link it and docs/ hold resolves.

The example is the ``python`` block under "## A first run", run unchanged as a script (one CPU
process, a few seconds of training) with a few lines appended that report what it did; it is forked
warm (``tests/helpers/warm.py``), as the app's end-to-end runs are.
"""

from __future__ import annotations

import json
import math
import re
import sys

from ddp_plugins.testing import check_ok
from tests.helpers import REPO_ROOT
from tests.helpers.warm import run_warm

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

# Appended to the example: what it trained and gathered, as one JSON line.
REPORT = """
import json as _json

_gathered = trainer.callbacks[[type(cb).__name__ for cb in trainer.callbacks].index("SequentialEvaluation")]
_val_targets = _gathered.results["validate"]["target"]
_norms = {f"{type(m).__module__}.{type(m).__name__}" for m in model.modules() if "Norm" in type(m).__name__}
print("README-EXAMPLE " + _json.dumps({
    "global_step": trainer.global_step,
    "max_epochs": trainer.max_epochs,
    "batches_per_epoch": trainer.num_training_batches,
    "exact_acc": float(trainer.callback_metrics["val/exact_acc"]),
    "acc": float(trainer.callback_metrics["val/acc"]),
    "val_rows": len(data.val_set),
    "gathered_in_order": _val_targets.tolist() == data.val_set.tensors[1].tolist(),
    "norm_classes": sorted(_norms),
}))
"""


def first_example() -> str:
    """The first ``python`` block after the "## A first run" heading of the README."""
    text = README.read_text()
    start = text.index("\n## A first run\n")
    language, code = FENCE.search(text, start).groups()
    assert language == "python", f"the block after '## A first run' should be python, got {language!r}"
    return code


def test_readme_example_runs_as_written_and_trains(tmp_path):
    (tmp_path / "readme_example.py").write_text(first_example() + REPORT)
    result = check_ok(run_warm([sys.executable, "-m", "readme_example"], timeout=180, cwd=tmp_path))
    lines = [line for line in result.stdout.splitlines() if line.startswith("README-EXAMPLE ")]
    assert len(lines) == 1, f"the example should report once, got:\n{result.stdout[-3000:]}"
    run = json.loads(lines[0].removeprefix("README-EXAMPLE "))

    # AccumulationNoSync(2): one optimizer step per 2 micro-batches, the epoch's last batch closing its window
    assert run["batches_per_epoch"] == math.ceil(1438 / 32), run  # the digits' training rows, batch 32
    assert run["global_step"] == run["max_epochs"] * math.ceil(run["batches_per_epoch"] / 2), run
    # SequentialEvaluation gathered every validation row once, in dataset order; on one process its
    # exact accuracy is the model's own over the same rows, and the model learned
    assert run["val_rows"] == 359 and run["gathered_in_order"], run
    assert abs(run["exact_acc"] - run["acc"]) < 1e-6, run
    assert run["exact_acc"] > 0.9, f"3 epochs on the digits should pass 0.9 accuracy, got {run['exact_acc']}"
    # SyncBatchNormCallback put the model's own BatchNorm classes back when fitting ended
    assert run["norm_classes"] == ["torch.nn.modules.batchnorm.BatchNorm2d"], run


def _anchors(page: str) -> set[str]:
    """GitHub's heading anchors of a Markdown page (code blocks left out)."""
    anchors: set[str] = set()
    for line in FENCE.sub("", page).splitlines():
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            n = 0
            while (anchor := slug if n == 0 else f"{slug}-{n}") in anchors:
                n += 1
            anchors.add(anchor)
    return anchors


def test_links_in_readme_and_docs_resolve():
    broken = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such file)")
            elif anchor and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such heading)")
    assert broken == [], "links that lead nowhere:\n" + "\n".join(broken)


def test_readme_guides_in_200_lines_and_links_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, f"the README should guide in 200 lines or fewer, has {len(text.splitlines())}"
    linked = {target.partition("#")[0] for target in LINK.findall(FENCE.sub("", text))}
    unlinked = [page.name for page in sorted(DOCS.glob("*.md")) if f"docs/{page.name}" not in linked]
    assert unlinked == [], f"docs pages the README does not link: {unlinked}"
