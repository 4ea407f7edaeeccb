"""Checkpoint files that are whole or absent
===========================================

Lightning's ``TorchCheckpointIO`` serializes to memory and then writes the bytes straight to the
final name: a full disk or a kill during the write leaves a truncated ``.ckpt`` there, which the
next run takes for the latest checkpoint. :class:`AtomicCheckpointIO` writes local files through
:func:`ddp_plugins.core.save_atomic` (temporary name in the same folder, fsync, rename) and leaves
remote (fsspec) paths to Lightning.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from ddp_plugins.core.process import save_atomic

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic: a checkpoint is complete or not there.

    Example::

        >>> import tempfile, os
        >>> folder = tempfile.mkdtemp()
        >>> AtomicCheckpointIO().save_checkpoint({"global_step": 3}, os.path.join(folder, "a.ckpt"))
        >>> os.listdir(folder)
        ['a.ckpt']
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):  # remote filesystems: Lightning's fsspec path
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        save_atomic(checkpoint, path)
