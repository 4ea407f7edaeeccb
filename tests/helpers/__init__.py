"""Test helpers; the multi-process harness itself is :mod:`ddp_plugins.testing`."""

from pathlib import Path

#: The checkout: its ``tests`` package is importable from every process the tests start (conftest).
REPO_ROOT = Path(__file__).resolve().parents[2]
