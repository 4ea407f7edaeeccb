"""Models for the app's ``model._target_`` in tests (child ranks import them by this path), and the small
generated dataset the Lightning-level tests train their MLPs on."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from ddp_plugins.app.demo.model import DigitsCNN


def three_classes(rows: int, seed: int, features: int = 4) -> TensorDataset:
    """``rows`` rows of ``features`` normal features, labelled 0 to 2 by the first two features."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


class SGDMomentumCNN(DigitsCNN):
    """The demo CNN with SGD (lr 0.05, momentum 0.9) and no schedule, as in issue 49."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class BatchNorm1dHeadCNN(DigitsCNN):
    """The demo CNN with a BatchNorm1d before its linear head: a virtual shard of 1 row cannot train it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head = torch.nn.Sequential(torch.nn.BatchNorm1d(self.head.in_features), self.head)


class SmoothCNN(SGDMomentumCNN):
    """The demo CNN made smooth (tanh, average pooling), with or without BatchNorm: float32 runs that add
    their sums in another order stay within float32 noise of each other (a ReLU input within rounding
    of 0 takes either side, and so does a max-pooling tie)."""

    def __init__(self, batchnorm: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.features = torch.nn.Sequential(
            *(
                torch.nn.Tanh() if isinstance(layer, torch.nn.ReLU)
                else torch.nn.AvgPool2d(2) if isinstance(layer, torch.nn.MaxPool2d)
                else layer if batchnorm or not isinstance(layer, torch.nn.BatchNorm2d)
                else torch.nn.Identity()
                for layer in self.features
            )
        )  # fmt: skip
