"""Helpers shared by the notebooks: hand per-rank results from the DDP workers back to the notebook.

With ``strategy="ddp_plugins_notebook"`` the ranks are forked workers; what they compute stays in their
processes except rank 0's final weights and ``callback_metrics``. A rank writes what the notebook
should see with :func:`save_rank` (temporary name, then rename) and the notebook reads every rank's
file, ordered by rank, with :func:`load_ranks`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ddp_plugins.core import save_atomic

__all__ = ["load_ranks", "save_rank"]


def save_rank(out_dir: str | os.PathLike, rank: int, obj: Any) -> Path:
    """Write ``obj`` to ``out_dir/rank{rank}.pt`` (a temporary name first, then renamed)."""
    return save_atomic(obj, Path(out_dir) / f"rank{rank}.pt")


def load_ranks(out_dir: str | os.PathLike, world_size: int) -> list[Any]:
    """What every rank wrote with :func:`save_rank`, as a list ordered by rank.

    Raises:
        FileNotFoundError: a rank wrote nothing (the message names the missing ranks).
    """
    paths = [Path(out_dir) / f"rank{rank}.pt" for rank in range(world_size)]
    missing = [rank for rank, path in enumerate(paths) if not path.exists()]
    if missing:
        raise FileNotFoundError(f"no results from rank(s) {missing} in {out_dir}; did the run fail?")
    return [torch.load(path, weights_only=False) for path in paths]
