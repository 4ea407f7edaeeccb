"""The embedded default job: scikit-learn's 8x8 digits (no download) and a small CNN with BatchNorm.

Example::

    >>> from ddp_plugins.app.demo import DigitsCNN, SyntheticDataModule
    >>> dm = SyntheticDataModule(num_samples=64, image_size=8, batch_size=16)
    >>> dm.setup()
    >>> x, y = next(iter(dm.train_dataloader()))
    >>> tuple(DigitsCNN(num_classes=dm.num_classes)(x).shape)
    (16, 10)
"""

from ddp_plugins.app.demo.data import DigitsDataModule, SyntheticDataModule
from ddp_plugins.app.demo.model import DigitsCNN

__all__ = ["DigitsCNN", "DigitsDataModule", "SyntheticDataModule"]
