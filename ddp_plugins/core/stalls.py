"""When a collective fails, name the rank that stopped progressing (each rank whose collective failed
records itself in the process group's store); a failed rendezvous is one line."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, cast

import torch.distributed as dist

from ddp_plugins._compat import default_store
from ddp_plugins.core.ranks import is_distributed

__all__ = [
    "COLLECTIVE_FAILURES",
    "RendezvousError",
    "describe_collective_failure",
    "is_collective_failure",
    "rendezvous_error",
    "stalled_ranks",
]


class RendezvousError(RuntimeError):
    """The ranks did not all meet to make the process group; ``str()`` is one line."""


def rendezvous_error(
    error: BaseException, address: str, port: int, world_size: int, timeout_s: float
) -> RendezvousError:
    """A one-line :class:`RendezvousError` for a store or network error raised while the group is made.

    Example::

        >>> err = RuntimeError("Timed out after 16 seconds waiting for clients. 2/4 clients joined.")
        >>> message = str(rendezvous_error(err, "127.0.0.1", 29500, 4, 15))
        >>> message.startswith("the 4 ranks did not all meet at 127.0.0.1:29500 within the timeout (15 s): Timed")
        True
    """
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return RendezvousError(
        f"the {world_size} ranks did not all meet at {address}:{port} within the timeout ({timeout_s:g} s):"
        f" {first} Check that every node started and can reach that address."
    )


# Messages of a collective that failed because a peer stopped or is gone (gloo, NCCL, the TCP store).
COLLECTIVE_FAILURES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out",
    "timed out",
    "Application timeout",
    "Socket Timeout",
    "NCCL communicator was aborted",
    "failed to recv",
    "failed to send",
)
_KEY = "ddp_plugins/failed_in_collective"
_ANSWER = "ddp_plugins_stalled"  # the attribute of the error that keeps the answer


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because a peer stopped (timeout, closed connection).

    Example::

        >>> is_collective_failure(RuntimeError("Application timeout caused pair closure"))
        True
        >>> is_collective_failure(ValueError("bad batch"))
        False
    """
    return isinstance(error, RuntimeError) and any(
        text in arg for arg in error.args if isinstance(arg, str) for text in COLLECTIVE_FAILURES
    )


def stalled_ranks(store: Any, rank: int, world_size: int, tag: str = "", grace_s: float = 3.0) -> list[int]:
    """Record that ``rank`` failed in a collective; return the ranks that record nothing within ``grace_s``.

    Every rank whose collective failed calls it with the same ``tag`` (say, the training step), so
    that an earlier failure in the same store does not count.

    Example::

        >>> import torch.distributed as dist
        >>> store = dist.HashStore()
        >>> _ = stalled_ranks(store, 2, 4, grace_s=0)  # rank 2 failed first ...
        >>> stalled_ranks(store, 0, 4, grace_s=0.1)  # ... then rank 0: ranks 1 and 3 never came
        [1, 3]
    """
    prefix = f"{_KEY}/{tag}/" if tag else f"{_KEY}/"
    store.set(f"{prefix}{rank}", "1")
    deadline = time.monotonic() + grace_s
    missing = [r for r in range(world_size) if r != rank]
    while True:
        missing = [r for r in missing if not store.check([f"{prefix}{r}"])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.05)


def describe_collective_failure(
    error: BaseException,
    store: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    tag: str = "",
    grace_s: float = 3.0,
) -> str | None:
    """One line naming the rank(s) that stopped, for a collective that failed on ``rank``; None
    when ``error`` is not such a failure or the store cannot answer (its host process is gone).

    ``store``, ``rank`` and ``world_size`` default to the default process group's. The store is
    asked from a helper thread, and given up on after ``grace_s`` plus 2 s: a store whose server
    died must not hold up the exit. The answer is kept on ``error``, so that the launcher and the
    strategy that both report it ask once.

    Example::

        >>> import torch.distributed as dist
        >>> store = dist.HashStore()
        >>> print(describe_collective_failure(RuntimeError("Connection closed by peer"), store, 0, 2, grace_s=0))
        rank 1 stopped progressing and never reached the collective that failed on rank 0: look there ...
    """
    if hasattr(error, _ANSWER):
        return cast("str | None", getattr(error, _ANSWER))
    if not is_collective_failure(error):
        return None
    if store is None or rank is None or world_size is None:
        if not is_distributed():
            return None
        store = default_store() if store is None else store
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    note = _ask_store(store, rank, world_size, tag, grace_s) if world_size > 1 else None
    with contextlib.suppress(AttributeError):  # an exception type without a __dict__
        setattr(error, _ANSWER, note)
    return note


def _ask_store(store: Any, rank: int, world_size: int, tag: str, grace_s: float) -> str | None:
    answer: list[list[int]] = []

    def ask() -> None:
        with contextlib.suppress(Exception):  # the store is gone with its host: no diagnosis, the error stands
            answer.append(stalled_ranks(store, rank, world_size, tag, grace_s))

    helper = threading.Thread(target=ask, name="ddp_plugins-stalled-ranks", daemon=True)
    helper.start()
    helper.join(grace_s + 2.0)
    if not answer:
        return None
    missing = answer[0]
    if not missing:
        return (
            f"every rank failed in a collective (rank {rank} too), none stopped elsewhere: the ranks called"
            " different collectives, or the network between them failed"
        )
    who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {', '.join(map(str, missing))}"
    return (
        f"{who} stopped progressing and never reached the collective that failed on rank {rank}:"
        " look there for an error, a kill or a wait elsewhere"
    )
