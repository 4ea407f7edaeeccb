"""DDP communication hooks by name, and counters of what hooks and ``torch.distributed`` collectives send."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ddp_plugins.core.checks import ArgumentTypeError, ArgumentValueError, check_choice, check_int

__all__ = [
    "COMM_HOOKS",
    "CollectiveCounts",
    "CountingCommHook",
    "build_comm_hook",
    "check_comm_hook",
    "count_collectives",
]

#: The names of the DDP communication hooks, for :func:`build_comm_hook` and :func:`check_comm_hook`.
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


def check_comm_hook(comm_hook: Any, backend: str | None = None) -> None:
    """Check a DDP communication hook name, and that ``backend`` (when known) can run it.

    Raises:
        ArgumentValueError: an unknown name, or ``bf16`` without NCCL 2.10+ (torch registers it on nccl only).

    Example::

        >>> check_comm_hook("fp16", "gloo")  # fine: returns None
        >>> check_comm_hook("bf16", "gloo")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `comm_hook` should be ..., got 'bf16' with the gloo backend.
    """
    check_choice("comm_hook", comm_hook, COMM_HOOKS)
    if comm_hook != "bf16" or backend is None:
        return
    nccl = torch.cuda.nccl.version() if backend == "nccl" and torch.cuda.is_available() else None
    if nccl is None or tuple(nccl)[:2] < (2, 10):
        found = f"NCCL {'.'.join(map(str, nccl))}" if nccl else f"the {backend} backend"
        allowed = "'none', 'fp16' or 'powersgd' (any backend), or 'bf16' with the nccl backend and NCCL 2.10+"
        raise ArgumentValueError("comm_hook", allowed, problem=f"got 'bf16' with {found}")


def build_comm_hook(
    name: str, process_group: Any = None, powersgd_rank: int = 1, powersgd_start_iter: int = 1000
) -> tuple[Any, Callable[..., Any] | None]:
    """The ``(state, hook)`` pair of torch's hook for a name: ``ddp.register_comm_hook(*build_comm_hook("fp16"))``.

    Build one pair per DDP model: PowerSGD keeps per-model state.

    Args:
        name: one of :data:`COMM_HOOKS`; ``"none"`` (DDP's default all-reduce) returns ``(None, None)``.
        powersgd_rank: PowerSGD's ``matrix_approximation_rank`` (>= 1).
        powersgd_start_iter: PowerSGD's ``start_powerSGD_iter`` (>= 2: its error feedback needs two
            warm-up iterations).

    Example::

        >>> state, hook = build_comm_hook("powersgd", powersgd_rank=2, powersgd_start_iter=10)
        >>> hook.__name__, state.matrix_approximation_rank, state.start_powerSGD_iter
        ('_powersgd_hook', 2, 10)
    """
    check_comm_hook(name)
    check_int("powersgd_rank", powersgd_rank, 1)
    check_int("powersgd_start_iter", powersgd_start_iter, 2)
    if name == "none":
        return None, None
    if name in ("fp16", "bf16"):
        return process_group, getattr(default_hooks, f"{name}_compress_hook")
    state = powerSGD_hook.PowerSGDState(process_group, powersgd_rank, start_powerSGD_iter=powersgd_start_iter)
    return state, _powersgd_hook


def _powersgd_hook(state, bucket):
    """torch's ``powerSGD_hook``; on backends other than NCCL it returns once the bucket is reduced.

    PowerSGD issues its later all-reduces from future callbacks, which gloo runs on its own threads:
    they could interleave differently on each rank with other collectives (SyncBatchNorm's), and
    gloo aborts on the mismatch. Waiting keeps one order. No annotations: DDP compares them.
    """
    if not bucket.buffer().is_cuda and torch.cuda.is_available():
        _let_cuda_synchronize_skip_the_cpu()
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    if dist.get_backend(state.process_group) != "nccl":
        future.wait()
    return future


def _let_cuda_synchronize_skip_the_cpu() -> None:
    """Make ``torch.cuda.synchronize(<cpu device>)`` return at once instead of raising, process-wide.

    torch's ``powerSGD_hook`` (checked on 2.11 and 2.13) calls it with a CPU bucket's device whenever
    CUDA is available ("Expected a cuda device, but got: cpu"), from a callback on gloo's thread.
    """
    synchronize = torch.cuda.synchronize
    if getattr(synchronize, "skips_the_cpu", False):
        return

    def cpu_tolerant_synchronize(device: Any = None) -> None:
        if isinstance(device, (torch.device, str)) and torch.device(device).type == "cpu":
            return
        synchronize(device)

    cpu_tolerant_synchronize.skips_the_cpu = True  # type: ignore[attr-defined]
    torch.cuda.synchronize = cpu_tolerant_synchronize


class CountingCommHook:
    """A DDP communication hook that counts what another hook sends, then returns its result.

    ``calls`` and ``bytes`` count the ``all_reduce`` calls the hook issues on its own thread, at the
    size actually sent; collectives of a future's ``then`` (PowerSGD's second all-reduce) are not
    seen. ``rounds`` counts synchronized backward passes.

    Args:
        hook: the hook to wrap, ``hook(state, bucket) -> Future``; ``None`` means torch's ``allreduce_hook``.

    Example::

        >>> counter = CountingCommHook()
        >>> counter.calls, counter.bytes, counter.rounds
        (0, 0, 0)
        >>> # ddp_model.register_comm_hook(state=None, hook=counter)
    """

    def __init__(self, hook: Callable[[Any, dist.GradBucket], torch.futures.Future] | None = None) -> None:
        if hook is not None and not callable(hook):
            raise ArgumentTypeError("hook", "a DDP communication hook (callable) or None", hook)
        self.hook = hook if hook is not None else allreduce_hook
        self.__name__ = "counting_comm_hook"  # DDP and Lightning read these names
        self.__qualname__ = f"CountingCommHook({getattr(self.hook, '__qualname__', type(self.hook).__name__)})"
        self.calls = self.bytes = self.rounds = 0

    def __call__(self, state, bucket):
        # no annotations: DDP compares them with the real classes, and this module's are strings
        if self.hook is allreduce_hook:  # known to send the bucket once: counted without a patch
            future = self.hook(state, bucket)
            self.calls += 1
            self.bytes += sent_nbytes([bucket.buffer()])
        else:
            with count_collectives(("all_reduce",), this_thread=True) as counts:
                future = self.hook(state, bucket)
            self.calls += counts.calls["all_reduce"]
            self.bytes += counts.bytes["all_reduce"]
        if bucket.is_last():
            self.rounds += 1
        return future

    def reset(self) -> None:
        """Set every count back to zero."""
        self.calls = self.bytes = self.rounds = 0


@dataclass
class CollectiveCounts:
    """Calls and bytes per collective name, filled by :func:`count_collectives`.

    Example::

        >>> with count_collectives(("broadcast",)) as counts:
        ...     pass
        >>> isinstance(counts, CollectiveCounts), counts.calls["broadcast"], counts.bytes["broadcast"]
        (True, 0, 0)
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)


_active: list[tuple[CollectiveCounts, tuple[str, ...], int | None]] = []
_originals: dict[str, Callable[..., Any]] = {}
_lock = threading.Lock()


# Collectives whose first argument is the output: what they send is their second argument, by this keyword.
_SENT_ARGUMENT = {
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "input_list",
    "all_gather_single": "input_tensor",
    "reduce_scatter_single": "input",
    "reduce_scatter_tensor": "input",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
}


def sent_tensors(args: tuple, kwargs: dict, name: str = "") -> list[torch.Tensor]:
    """The tensors a collective sends: its input (the first tensor argument, or list of tensors)."""
    if name in _SENT_ARGUMENT:
        key = _SENT_ARGUMENT[name]
        args, kwargs = args[1:2], {key: kwargs[key]} if key in kwargs else {}
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return [value]
        if isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value):
            return list(value)
    return []


def sent_nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _counting(name: str) -> Callable[..., Any]:
    original = _originals[name]

    def counting(*args: Any, **kwargs: Any) -> Any:
        thread = threading.get_ident()
        for counts, names, only_thread in list(_active):
            if name in names and only_thread in (None, thread):
                counts.calls[name] += 1
                counts.bytes[name] += sent_nbytes(sent_tensors(args, kwargs, name))
        return original(*args, **kwargs)

    return counting


@contextlib.contextmanager
def count_collectives(
    names: Iterable[str] = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter"),
    *,
    this_thread: bool = False,
) -> Iterator[CollectiveCounts]:
    """Count the calls of ``torch.distributed`` collectives (and the bytes they send) while the body runs.

    The functions are patched while any counter is active; counters nest and may overlap across
    threads. Calls on a ``ProcessGroup`` object, or through a reference taken earlier, are not seen.

    Example::

        >>> with count_collectives(("all_reduce",)) as counts:
        ...     pass
        >>> counts.calls["all_reduce"], counts.bytes["all_reduce"]
        (0, 0)
    """
    names = tuple(names)
    for name in names:
        if not callable(getattr(dist, name, None)):
            raise ArgumentValueError("names", "names of torch.distributed collectives", name)
    counts = CollectiveCounts()
    entry = (counts, names, threading.get_ident() if this_thread else None)
    with _lock:
        for name in names:
            if name not in _originals:
                _originals[name] = getattr(dist, name)
                setattr(dist, name, _counting(name))
        _active.append(entry)
    try:
        yield counts
    finally:
        with _lock:
            _active.remove(entry)
            still = {n for _, active_names, _ in _active for n in active_names}
            for name in [n for n in _originals if n not in still]:
                setattr(dist, name, _originals.pop(name))
