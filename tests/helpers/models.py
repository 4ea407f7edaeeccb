"""Models for the app's ``model._target_`` in tests (child ranks import them by this path)."""

from __future__ import annotations

import torch

from ddp_plugins.app.demo.model import DigitsCNN


class SGDMomentumCNN(DigitsCNN):
    """The demo CNN with SGD (lr 0.05, momentum 0.9) and no schedule, as in issue 49."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class BatchNorm1dHeadCNN(DigitsCNN):
    """The demo CNN with a BatchNorm1d before its linear head: a virtual shard of 1 row cannot train it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head = torch.nn.Sequential(torch.nn.BatchNorm1d(self.head.in_features), self.head)
