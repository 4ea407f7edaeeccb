"""A callback that synchronizes batch norm while fitting, on CPU or GPU, with public Lightning hooks only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from ddp_plugins.core.sync_batchnorm import check_group_divides, revert_sync_batchnorm
from ddp_plugins.lightning.contracts import virtual_shards
from ddp_plugins.lightning.layer_sync import SyncBatchNormPlugin

__all__ = ["SyncBatchNormCallback"]


class SyncBatchNormCallback(Callback):
    """Synchronize batch norm while fitting, on CPU or GPU: ``Trainer(callbacks=[SyncBatchNormCallback()])``.

    Converts in place at ``on_fit_start`` (after DDP wrapped the model: the tensors stay), reverts at ``teardown``;
    not on one device nor in the reproducible mode. Arguments: :func:`~ddp_plugins.core.convert_sync_batchnorm`'s.

    Raises:
        ValueError: at ``on_fit_start``, a model already synchronized by ``Trainer(sync_batchnorm=True)``
            or a ``LayerSync`` plugin.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[SyncBatchNormCallback()], accelerator="cpu", logger=False)
    """

    def __init__(
        self,
        group_size: int | None = None,
        skip_frozen: bool = True,
        extra_classes: Sequence[type | str] | Mapping[Any, str] = (),
    ) -> None:
        self.plugin = SyncBatchNormPlugin(group_size=group_size, skip_frozen=skip_frozen, extra_classes=extra_classes)
        self._converted: nn.Module | None = None

    @property
    def report(self) -> Any:
        """The report of the last conversion, ``None`` before fitting."""
        return self.plugin.report

    def check_trainer(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The run-dependent check of ``setup``: ``group_size`` must divide the Trainer's world size."""
        check_group_divides(self.plugin.group_size, trainer.world_size)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.check_trainer(trainer, pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not isinstance(trainer.strategy, ParallelStrategy):
            rank_zero_info(
                f"SyncBatchNormCallback: {type(trainer.strategy).__name__} runs one device, nothing to synchronize."
            )
            return
        shards = virtual_shards(trainer.strategy)
        if shards is not None:
            rank_zero_info(
                f"SyncBatchNormCallback: the reproducible mode normalizes per virtual shard ({shards} per step),"
                " the same rows on any number of ranks; BatchNorm layers are left unsynchronized."
            )
            return
        synced = [name for name, layer in pl_module.named_modules() if _synchronized_elsewhere(layer)]
        if synced:
            raise ValueError(
                f"`SyncBatchNormCallback` found layers already synchronized ({', '.join(synced[:3])}) by"
                " `Trainer(sync_batchnorm=True)` or a LayerSync plugin. Use one of them: remove"
                " `sync_batchnorm=True` / the plugin, or the callback."
            )
        self._converted = self.plugin.apply(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._revert()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._revert()

    def _revert(self) -> None:
        if self._converted is not None:
            revert_sync_batchnorm(self._converted)
            self._converted = None


def _synchronized_elsewhere(layer: nn.Module) -> bool:
    """torch's SyncBatchNorm, or a layer converted by a plugin (the callback converts only on fit start)."""
    return isinstance(layer, nn.SyncBatchNorm) or "_sync_batchnorm_original" in type(layer).__dict__
