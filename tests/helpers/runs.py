"""Compare the end state of two app runs: final checkpoint and metrics CSV."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import torch


def final_state(run_dir: str | Path) -> dict[str, Any]:
    """Parameters, buffers, optimizer state, epoch and step of a run's ``checkpoints/last.ckpt``."""
    ckpt = torch.load(Path(run_dir) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return {
        "state_dict": ckpt["state_dict"],
        "optimizer_states": ckpt["optimizer_states"],
        "epoch": ckpt["epoch"],
        "global_step": ckpt["global_step"],
    }


def metrics_rows(run_dir: str | Path) -> list[dict[str, str]]:
    """The rows of the run's metrics CSV, without empty cells (a resumed header may order keys differently)."""
    with open(Path(run_dir) / "metrics" / "metrics.csv", newline="") as file:
        return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(file)]


def assert_equal_states(a: Any, b: Any, where: str = "") -> None:
    """Tensors ``torch.equal``, everything else ``==``, recursively; the path of the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"differs at {where}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"keys differ at {where}: {set(a) ^ set(b)}"
        for key in a:
            assert_equal_states(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"lengths differ at {where}"
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_states(x, y, f"{where}[{index}]")
    else:
        assert a == b, f"differs at {where}: {a!r} != {b!r}"
