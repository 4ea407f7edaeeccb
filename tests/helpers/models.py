"""Models for the app's ``model._target_`` in tests (child ranks import them by this path)."""

from __future__ import annotations

import torch

from ddp_plugins.app.demo.model import DigitsCNN


class SGDMomentumCNN(DigitsCNN):
    """The demo CNN with SGD (lr 0.05, momentum 0.9) and no schedule, as in issue 49."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
