"""Random-stream helpers for the seeding tests: isolate the global RNGs, draw from every generator, compare."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
from lightning.pytorch.utilities.seed import isolate_rng

_ENV_KEYS = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG")


class Isolated:
    """Restore the global RNGs, the seeding env variables and torch's determinism flags on exit."""

    def __enter__(self):
        self._rng = isolate_rng()
        self._rng.__enter__()
        self._env = {key: os.environ.get(key) for key in _ENV_KEYS}
        self._flags = (
            torch.are_deterministic_algorithms_enabled(),
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        )
        return self

    def __exit__(self, *exc):
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.use_deterministic_algorithms(self._flags[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = self._flags[1:]
        self._rng.__exit__(*exc)
        return False


def draw() -> dict:
    return {
        "torch": torch.rand(4),
        "numpy": np.random.rand(4),
        "python": [random.random() for _ in range(4)],
    }


def same(a: dict, b: dict) -> bool:
    return torch.equal(a["torch"], b["torch"]) and np.array_equal(a["numpy"], b["numpy"]) and a["python"] == b["python"]


def assert_all_differ(a: dict, b: dict, what: str) -> None:
    assert not torch.equal(a["torch"], b["torch"]), f"torch draws equal {what}, expected distinct streams"
    assert not np.array_equal(a["numpy"], b["numpy"]), f"NumPy draws equal {what}, expected distinct streams"
    assert a["python"] != b["python"], f"Python draws equal {what}, expected distinct streams"


# Seeds every seeding entry point refuses, with the exception each must raise.
BAD_SEEDS = [
    (-1, ValueError),
    (2**32, ValueError),
    (1.5, TypeError),
    ("42", TypeError),
    (True, TypeError),
    (None, TypeError),
]
