"""DDP communication hooks by name, and a hook that counts what another hook sends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ddp_plugins.core.checks import ArgumentTypeError, ArgumentValueError, check_choice, check_int

__all__ = ["COMM_HOOKS", "CountingCommHook", "build_comm_hook", "check_comm_hook"]

#: The names of the DDP communication hooks, for :func:`build_comm_hook` and :func:`check_comm_hook`.
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


def check_comm_hook(comm_hook: Any, backend: str | None = None, device: Any = None) -> None:
    """Check a DDP communication hook name, and that ``backend`` and ``device`` (when known) can run it.

    Raises:
        ArgumentValueError: an unknown name, ``bf16`` without NCCL 2.10+, or ``powersgd`` for a CPU model on a
            machine with CUDA (torch's hook synchronizes the bucket's device as a CUDA device).

    Example::

        >>> check_comm_hook("fp16", "gloo")  # fine: returns None
        >>> check_comm_hook("bf16", "gloo")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `comm_hook` should be ..., got 'bf16' with the gloo backend.
    """
    check_choice("comm_hook", comm_hook, COMM_HOOKS)
    if comm_hook == "powersgd" and device is not None and torch.device(device).type == "cpu":
        if torch.cuda.is_available():
            allowed = "'none' or 'fp16' for a CPU model on a machine with CUDA"
            hint = "Train on the GPUs, or hide them (CUDA_VISIBLE_DEVICES=)."
            raise ArgumentValueError("comm_hook", allowed, comm_hook, hint=hint)
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
        powersgd_start_iter: PowerSGD's ``start_powerSGD_iter`` (>= 2: its error feedback needs two warm-ups).

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

    Its later all-reduces, from future callbacks on gloo's threads, could interleave differently per rank: an abort
    (docs/design.md, "Gradient accumulation and communication"). No annotations: DDP compares them.
    """
    check_comm_hook("powersgd", device=bucket.buffer().device)
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    if dist.get_backend(state.process_group) != "nccl":
        future.wait()
    return future


_HALF = (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook)
_POWERSGD = (_powersgd_hook, powerSGD_hook.powerSGD_hook)


class CountingCommHook:
    """A DDP communication hook that counts what another hook sends, then returns its result.

    By hand: torch has no per-hook traffic counter. ``calls`` and ``bytes`` count the all-reduces and their bytes:
    the bucket for torch's all-reduce, 2-byte elements for fp16/bf16, PowerSGD's three once it compresses (from
    ``total_numel_after_compression``); any other hook as one of the bucket. ``rounds``: synchronized backwards.

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
        buffer = bucket.buffer()
        numel, size = buffer.numel(), buffer.element_size()
        compressed = state.total_numel_after_compression if self.hook in _POWERSGD else 0
        future = self.hook(state, bucket)
        if self.hook in _POWERSGD and state.total_numel_after_compression > compressed:
            self.calls += 3
            self.bytes += (state.total_numel_after_compression - compressed) * size
        else:
            self.calls += 1
            self.bytes += numel * (2 if self.hook in _HALF else size)
        if bucket.is_last():
            self.rounds += 1
        return future

    def reset(self) -> None:
        """Set every count back to zero."""
        self.calls = self.bytes = self.rounds = 0
