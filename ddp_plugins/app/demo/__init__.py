"""The embedded default job: scikit-learn's 8x8 digits (no download) and a small CNN with BatchNorm."""

from ddp_plugins.app.demo.data import DigitsDataModule, SyntheticDataModule
from ddp_plugins.app.demo.model import DigitsCNN

__all__ = ["DigitsCNN", "DigitsDataModule", "SyntheticDataModule"]
