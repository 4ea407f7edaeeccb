"""Demo model: a small CNN with BatchNorm for 8x8 single-channel images."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from ddp_plugins.core.checks import check_int, check_number


class DigitsCNN(pl.LightningModule):
    """Conv-BN-ReLU x3, global average pooling, a linear head; Adam with a cosine schedule.

    Logs ``train/loss``, ``val/loss``, ``val/acc``; validation and test steps return ``{"preds": logits, "target":
    labels}`` (for :class:`ddp_plugins.SequentialEvaluation`), ``predict_step`` class probabilities.

    Example::

        >>> model = DigitsCNN(channels=8)
        >>> model(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 10, channels: int = 32, lr: float = 3e-3, dropout: float = 0.0):
        super().__init__()
        check_int("num_classes", num_classes, 2)
        check_int("channels", channels, 1)
        check_number("lr", lr, 0, exclusive_minimum=True)
        check_number("dropout", dropout, 0, 1, exclusive_maximum=True)
        self.save_hyperparameters()
        c = channels

        def conv_bn_relu(c_in: int, c_out: int) -> list[nn.Module]:
            return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

        convs = [*conv_bn_relu(1, c), *conv_bn_relu(c, 2 * c), nn.MaxPool2d(2), *conv_bn_relu(2 * c, 2 * c)]
        self.features = nn.Sequential(*convs, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout))
        self.head = nn.Linear(2 * c, num_classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)  # the step's mean over every rank's rows
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.log("val/acc", self.val_acc, prog_bar=True)
        return {"preds": logits, "target": y}

    def test_step(self, batch, batch_idx):
        x, y = batch
        return {"preds": self(x), "target": y}

    def predict_step(self, batch, batch_idx):
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(x).softmax(dim=1)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
        max_epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 10
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max_epochs)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}
