""":func:`ddp_plugins.core.convert_sync_batchnorm` as a Lightning ``LayerSync`` plugin."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from ddp_plugins.core.sync_batchnorm import (
    SyncBatchNormReport,
    check_sync_batchnorm_args,
    convert_sync_batchnorm,
    normalize_extra_classes,
    revert_sync_batchnorm,
)

__all__ = ["SyncBatchNormPlugin"]


class SyncBatchNormPlugin(LayerSync):
    """Lightning ``LayerSync`` plugin: :func:`convert_sync_batchnorm` before DDP wraps the model, revert after.

    ``DDPPluginsStrategy`` puts it in place of torch's ``TorchSyncBatchNorm``, which runs on accelerators only.
    The arguments are :func:`convert_sync_batchnorm`'s.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(accelerator="cpu", plugins=[SyncBatchNormPlugin()], logger=False)
    """

    def __init__(
        self,
        process_group: Any = None,
        group_size: int | None = None,
        skip_frozen: bool = True,
        extra_classes: Sequence[type | str] | Mapping[Any, str] = (),
    ) -> None:
        check_sync_batchnorm_args(process_group, group_size, skip_frozen)
        self.process_group = process_group
        self.group_size = group_size
        self.skip_frozen = skip_frozen
        self.extra_classes = normalize_extra_classes(extra_classes)
        self.report: SyncBatchNormReport | None = None

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        model, self.report = convert_sync_batchnorm(
            model,
            self.process_group,
            group_size=self.group_size,
            skip_frozen=self.skip_frozen,
            extra_classes=self.extra_classes,
            return_report=True,
        )
        rank_zero_info(str(self.report))
        return model

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)
