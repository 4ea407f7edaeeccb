"""Weights-only loads that take what Lightning + Hydra projects save, and refuse the rest in one line."""

from __future__ import annotations

import argparse
import collections
import contextlib
import pathlib
import pickle
import re
import typing
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from omegaconf.base import ContainerMetadata, Metadata
from omegaconf.nodes import AnyNode, BooleanNode, BytesNode, EnumNode, FloatNode, IntegerNode, PathNode, StringNode

__all__ = ["SAFE_GLOBALS", "UnsafeCheckpointError", "safe_loading"]

#: What the pack's weights-only loads take besides torch's own: the OmegaConf containers Hydra passes and what they
#: pickle, ``argparse.Namespace``, paths. Data only (a loaded interpolation resolves through this process's resolvers);
#: a nested ``AttributeDict`` is still refused (torch fills no ``dict`` subclass but ``OrderedDict`` and ``Counter``).
SAFE_GLOBALS: tuple[Any, ...] = (
    DictConfig, ListConfig, ContainerMetadata, Metadata,
    AnyNode, StringNode, IntegerNode, FloatNode, BooleanNode, BytesNode, PathNode, EnumNode,
    typing.Any, dict, list, int, float, str, bool, bytes, collections.defaultdict,
    argparse.Namespace, pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath,
)  # fmt: skip

# torch's refusal names the first global it met: "Unsupported global: GLOBAL torch.nn.Linear was not ..."
_TORCH_NAMES = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module)")


class UnsafeCheckpointError(pickle.UnpicklingError, ValueError):
    """A checkpoint that ``weights_only=True`` refuses, in one line: the file, the globals it holds, the ways through.

    An ``UnpicklingError`` (torch's handlers catch it) and a ``ValueError``; keeps ``path``, ``names`` (sorted; empty
    where torch refuses something else, ``reason`` then says what) and ``held`` (what the message says it holds).

    Example::

        >>> str(UnsafeCheckpointError("a.ckpt", ["torch.nn.modules.linear.Linear"]))  # doctest: +ELLIPSIS
        'a.ckpt does not load with weights_only=True: it holds torch.nn.modules.linear.Linear. If you trust ...'
    """

    def __init__(self, path: Any, names: list[str], reason: str = "") -> None:
        self.path, self.names = str(path), sorted(names)
        refused = f"torch's weights-only unpickler refuses it ({reason})" if reason else "torch refuses it"
        self.held = f"it holds {', '.join(self.names)}" if self.names else refused
        super().__init__(
            f"{self.path} does not load with weights_only=True: {self.held}. If you trust the file, pass"
            " weights_only=False to fit/validate/test/predict (the app: weights_only=false); or save plain"
            " types in the checkpoint: self.save_hyperparameters(ignore=[...]) for modules and partials."
        )


@contextlib.contextmanager
def safe_loading(path: Any = None) -> Iterator[None]:
    """Weights-only loads inside the block also take :data:`SAFE_GLOBALS`; a refusal is one line.

    torch's allowlist grows for the block only (the user's additions stay); a refusal names ``path`` and, for a
    local file, every global it refuses (torch names the first).

    Example::

        >>> import os, tempfile
        >>> from omegaconf import OmegaConf
        >>> path = os.path.join(tempfile.mkdtemp(), "a.ckpt")
        >>> torch.save({"hyper_parameters": {"split": OmegaConf.create([55_000, 5_000, 10_000])}}, path)
        >>> with safe_loading(path):
        ...     torch.load(path, weights_only=True)["hyper_parameters"]
        {'split': [55000, 5000, 10000]}
    """
    added = [name for name in SAFE_GLOBALS if name not in torch.serialization.get_safe_globals()]
    with torch.serialization.safe_globals(added):
        try:
            yield
        except pickle.UnpicklingError as err:
            if isinstance(err, UnsafeCheckpointError):
                raise
            raise UnsafeCheckpointError(path, _refused(path, err), _reason(err)) from None


def _refused(path: Any, err: BaseException) -> list[str]:
    """The globals of ``path`` torch refuses (read without unpickling), else those its message names."""
    names: list[str] = []
    if path is not None and "://" not in str(path):
        with contextlib.suppress(Exception):  # not a zip file of torch.save, or gone: torch's message says
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    return names or _TORCH_NAMES.findall(str(err))


def _reason(err: BaseException) -> str:
    """What torch says after its boilerplate (after ``WeightsUnpickler error:``), else its first line."""
    text = str(err)
    _, marker, rest = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (rest if marker else text).splitlines() if line.strip()]
    return lines[0][:200] if lines else ""
