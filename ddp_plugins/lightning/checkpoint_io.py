"""Checkpoint files that are whole or absent, verified, and loaded with ``weights_only=True`` by default."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from ddp_plugins.core.checkpoints import remove_checkpoint_file, save_checkpoint_file
from ddp_plugins.lightning.safe_loading import safe_loading

__all__ = ["AtomicCheckpointIO"]


def _remote(path: Any) -> bool:
    return "://" in str(path)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local checkpoints are atomic and verified, loaded with ``weights_only=True``.

    ``DDPPluginsStrategy``'s default; see docs/design.md, "Checkpoints and resume". Sidecars go in a hidden
    ``.sha256`` folder, so the names stay Lightning's; remote (fsspec) paths are Lightning's.

    Example::

        >>> import tempfile, os
        >>> folder = tempfile.mkdtemp()
        >>> io = AtomicCheckpointIO()
        >>> io.save_checkpoint({"global_step": 3}, os.path.join(folder, "a.ckpt"))
        >>> sorted(os.listdir(folder)), io.load_checkpoint(os.path.join(folder, "a.ckpt"))
        (['.sha256', 'a.ckpt'], {'global_step': 3})
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or _remote(path):  # remote filesystems: Lightning's fsspec path
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        save_checkpoint_file(checkpoint, path)

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        kwargs = {} if map_location is None else {"map_location": map_location}
        if weights_only is False:  # the user trusts the file
            return super().load_checkpoint(path, weights_only=False, **kwargs)
        with safe_loading(path):
            return super().load_checkpoint(path, weights_only=True, **kwargs)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        if _remote(path):
            super().remove_checkpoint(path)
            return
        remove_checkpoint_file(path)
