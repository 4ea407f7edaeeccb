"""Checkpoint files with a SHA-256 sidecar, verified before loading; per-rank state gathered at save."""

from __future__ import annotations

import errno
import hashlib
import os
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_plugins.core.files import is_temporary, save_atomic, write_text_atomic
from ddp_plugins.core.ranks import get_world_size

__all__ = [
    "DIGEST_SUFFIX",
    "NO_DIGEST",
    "PER_RANK",
    "digest_path",
    "gather_per_rank",
    "latest_checkpoint",
    "newest_valid_checkpoint",
    "remove_checkpoint_file",
    "remove_stale_temporaries",
    "save_checkpoint_file",
    "verify_checkpoint",
    "write_number",
    "write_order",
]

#: The key of a callback state's per-rank part, which :func:`gather_per_rank` gathers.
PER_RANK = "per_rank"


def gather_per_rank(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Replace each callback's :data:`PER_RANK` part by all ranks' (in place): one ``all_gather_object`` on every rank.

    Example::

        >>> gather_per_rank({"callbacks": {"Seed": {"per_rank": {"s": 1}, "seed": 3}}})
        {'callbacks': {'Seed': {'per_rank': [{'s': 1}], 'seed': 3}}}
    """
    callbacks = checkpoint.get("callbacks") or {}
    states = [callbacks[key] for key in sorted(callbacks)]  # a fixed order on every rank
    slots = [state for state in states if isinstance(state, dict) and PER_RANK in state]
    if not slots:
        return checkpoint
    mine = [slot[PER_RANK] for slot in slots]
    gathered: list[Any] = [mine] * get_world_size()
    if len(gathered) > 1:
        dist.all_gather_object(gathered, mine)
    for index, slot in enumerate(slots):
        slot[PER_RANK] = [rank_parts[index] for rank_parts in gathered]
    return checkpoint


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The ``*.ckpt`` file of ``folder`` written last (None if there is none), by :func:`write_order`.

    Example::

        >>> import os, tempfile
        >>> from ddp_plugins.core.checkpoints import save_checkpoint_file
        >>> folder = Path(tempfile.mkdtemp())
        >>> for name in ("epoch=0.ckpt", "step=12.ckpt"):
        ...     _ = save_checkpoint_file({"name": name}, folder / name)
        >>> os.utime(folder / "epoch=0.ckpt")  # touched later, as a copy would
        >>> latest_checkpoint(folder).name
        'step=12.ckpt'
    """
    return next(iter(_newest_first(folder)), None)


def write_number(path: str | os.PathLike) -> int | None:
    """The write number of a checkpoint in its folder, from its digest sidecar (None without one).

    Example::

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> paths = [save_checkpoint_file({}, folder / name) for name in ("a.ckpt", "b.ckpt", "a.ckpt")]
        >>> write_number(folder / "a.ckpt"), write_number(folder / "b.ckpt"), write_number(folder / "c.ckpt")
        (3, 2, None)
    """
    return _recorded_number(digest_path(path))


def write_order(path: str | os.PathLike) -> tuple[int, int]:
    """A checkpoint's sort key, oldest first: its write number (-1 without one; it survives a copy), then its mtime.

    Example::

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> paths = [save_checkpoint_file({}, folder / name) for name in ("b.ckpt", "a.ckpt")]
        >>> [p.name for p in sorted(paths, key=write_order)]
        ['b.ckpt', 'a.ckpt']
    """
    number = write_number(path)
    return (-1 if number is None else number, Path(path).stat().st_mtime_ns)


def _recorded_number(sidecar: Path) -> int | None:
    try:
        text = sidecar.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    found = _WRITE_NUMBER.search(text)
    return int(found.group(1)) if found else None


def _newest_first(folder: str | os.PathLike) -> list[Path]:
    found = [p for p in Path(folder).glob("*.ckpt") if not p.name.startswith(".") and p.is_file()]  # none: no folder
    return sorted(found, key=lambda p: (*write_order(p), p.name), reverse=True)


DIGEST_SUFFIX = ".sha256"
# hidden: Lightning parses the names beside checkpoints (`hpc_ckpt_1.ckpt.sha256` was hpc version 1256; `-v<N>`, `last`)
_DIGEST_FOLDER = ".sha256"
_UNNUMBERED = "its digest has no write number (made by hand?): its place among the checkpoints is unknown"
NO_DIGEST = "no digest"  # how verify_checkpoint's reason begins for a file without a sidecar
# the sidecar's second line: a comment to `sha256sum -c`, which still checks the file
_WRITE_NUMBER = re.compile(r"^# write (\d+)$", re.MULTILINE)


def digest_path(path: str | os.PathLike) -> Path:
    """A checkpoint's (a link's target's) sidecar: ``.sha256/<name>.sha256``, or an older one beside it if only that.

    Example::

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> path = save_checkpoint_file({}, folder / "hpc_ckpt_1.ckpt")
        >>> digest_path(path).relative_to(folder).as_posix()
        '.sha256/hpc_ckpt_1.ckpt.sha256'
        >>> _ = (folder / "old.ckpt").write_bytes(b"x"); _ = (folder / "old.ckpt.sha256").write_text("")
        >>> digest_path(folder / "old.ckpt").name, digest_path(folder / "new.ckpt").parent.name
        ('old.ckpt.sha256', '.sha256')
    """
    path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    sidecar, legacy = _sidecar_home(path), _legacy_sidecar(path)
    return legacy if not sidecar.exists() and legacy.exists() else sidecar


def _sidecar_home(path: Path) -> Path:
    """Where :func:`save_checkpoint_file` writes ``path``'s sidecar."""
    return path.parent / _DIGEST_FOLDER / (path.name + DIGEST_SUFFIX)


def _legacy_sidecar(path: Path) -> Path:
    """Where earlier versions wrote ``path``'s sidecar: beside it (Lightning's scans read it)."""
    return path.with_name(path.name + DIGEST_SUFFIX)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint_file(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` atomically; SHA-256 and :func:`write_number` go to :func:`digest_path` before the rename.

    Example::

        >>> import tempfile
        >>> path = save_checkpoint_file({"global_step": 3}, Path(tempfile.mkdtemp()) / "a.ckpt")
        >>> sorted(p.name for p in path.parent.iterdir()), verify_checkpoint(path)
        (['.sha256', 'a.ckpt'], None)
    """
    path = Path(path)

    def write_digest(tmp: Path) -> None:
        folder = path.parent  # every sidecar there, of this version and of earlier ones
        sidecars = [*(folder / _DIGEST_FOLDER).glob("*" + DIGEST_SUFFIX), *folder.glob("*.ckpt" + DIGEST_SUFFIX)]
        numbers = (_recorded_number(sidecar) for sidecar in sidecars)
        number = 1 + max((n for n in numbers if n is not None), default=0)
        write_text_atomic(_sidecar_home(path), f"{_sha256(tmp)}  {path.name}\n# write {number}\n")

    try:
        save_atomic(obj, path, before_rename=write_digest)
    except BaseException as err:
        if _no_space(err):
            raise OSError(errno.ENOSPC, f"cannot write checkpoint {path}: no space left on device") from None
        raise
    _legacy_sidecar(path).unlink(missing_ok=True)  # stale: the digest of the file just replaced
    return path


def _no_space(error: BaseException | None) -> bool:
    while error is not None:
        if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def remove_checkpoint_file(path: str | os.PathLike) -> None:
    """Remove a checkpoint and its digest, of any version (any may be missing; a link's target keeps its own)."""
    path = Path(path)
    for file in (path, _sidecar_home(path), _legacy_sidecar(path)):
        file.unlink(missing_ok=True)


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a whole checkpoint written by this pack, or None (nothing is unpickled).

    Example::

        >>> import tempfile
        >>> path = save_checkpoint_file({"w": 1}, Path(tempfile.mkdtemp()) / "a.ckpt")
        >>> with open(path, "r+b") as f:
        ...     _ = f.seek(100); _ = f.write(b"garbage")
        >>> verify_checkpoint(path)
        'damaged: its SHA-256 does not match a.ckpt.sha256'
        >>> verify_checkpoint(path.with_name("b.ckpt"))
        'no such file'
    """
    path = Path(path)
    if not path.is_file():
        return "no such file"
    sidecar = digest_path(path)
    if not sidecar.is_file():
        return f"{NO_DIGEST} ({sidecar.name} missing): not a checkpoint written by ddp_plugins 0.3.1 or later"
    try:
        recorded = sidecar.read_text().split()[0]
    except (OSError, IndexError, UnicodeDecodeError):
        recorded = ""
    if not re.fullmatch(r"[0-9a-f]{64}", recorded):
        return f"{NO_DIGEST} ({sidecar.name} holds no SHA-256: garbled or empty)"
    try:
        actual = _sha256(path)
    except OSError as err:
        return f"unreadable ({err.strerror or err})"
    return None if actual == recorded else f"damaged: its SHA-256 does not match {sidecar.name}"


def newest_valid_checkpoint(folder: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest ``*.ckpt`` passing :func:`verify_checkpoint`, and the newer ones skipped (unnumbered too), with why.

    Example::

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> good = save_checkpoint_file({"step": 1}, folder / "step-1.ckpt")
        >>> cut = save_checkpoint_file({"step": 2}, folder / "step-2.ckpt")
        >>> _ = cut.write_bytes(cut.read_bytes()[:100])
        >>> found, skipped = newest_valid_checkpoint(folder)
        >>> found.name, [(p.name, why.split(":")[0]) for p, why in skipped]
        ('step-1.ckpt', [('step-2.ckpt', 'damaged')])
    """
    skipped: list[tuple[Path, str]] = []
    ordered = _newest_first(folder)
    for index, path in enumerate(ordered):
        reason = verify_checkpoint(path)
        if reason is None:
            # unnumbered files sort after numbered ones: still name those written after this one
            after = path.stat().st_mtime_ns
            for other in ordered[index + 1 :]:
                if write_number(other) is None and other.stat().st_mtime_ns > after:
                    skipped.append((other, verify_checkpoint(other) or _UNNUMBERED))
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove a killed writer's temporaries and orphan digests (while nobody writes there); returns what went.

    Example::

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> for name in (".step-4.ckpt.123.tmp", "gone.ckpt.sha256", "kept.ckpt"):
        ...     _ = (folder / name).write_text("x")
        >>> sorted(p.name for p in remove_stale_temporaries(folder)), [p.name for p in folder.iterdir()]
        (['.step-4.ckpt.123.tmp', 'gone.ckpt.sha256'], ['kept.ckpt'])
    """
    removed = []
    folder = Path(folder)
    for path in [*folder.glob("*"), *(folder / _DIGEST_FOLDER).glob("*")]:  # hidden files too; none without the folder
        checkpoint = folder / path.name[: -len(DIGEST_SUFFIX)]
        orphan = path.name.endswith(".ckpt" + DIGEST_SUFFIX) and not checkpoint.exists()
        if (is_temporary(path) or orphan) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
