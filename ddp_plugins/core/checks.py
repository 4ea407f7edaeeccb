"""Argument validators: :class:`ArgumentTypeError` for a wrong type, :class:`ArgumentValueError` for a wrong value."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "ArgumentValueError",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
]


class _Unset:
    """The default of an argument that was not given (``<unset>`` in signatures and docs)."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


class ArgumentError(Exception):
    """A bad argument: ``argument`` (its name), ``got`` (what was received), ``allowed`` (what is).

    The message: "`<argument>` should be <allowed>, <problem>." and ``hint``; ``problem`` defaults to "got <got>".

    Example::

        >>> try:
        ...     check_int("devices", 0, 1)
        ... except ArgumentError as err:
        ...     print(err.argument, "|", err.problem, "|", err.allowed)
        devices | got 0 | an integer >= 1
    """

    def __init__(self, argument: str, allowed: str, got: Any = _UNSET, *, problem: str | None = None, hint: str = ""):
        self.argument, self.allowed, self.got, self.hint = argument, allowed, got, hint
        self.problem = problem if problem is not None else f"got {got!r}"
        text = f"`{argument}` should be {allowed}, {self.problem}."
        super().__init__(f"{text} {hint}" if hint else text)


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong type (a ``TypeError``).

    Example::

        >>> isinstance(ArgumentTypeError("flag", "True or False", "yes"), TypeError)
        True
    """


class ArgumentValueError(ArgumentError, ValueError):
    """An argument of the right type with a value that is not allowed (a ``ValueError``).

    Example::

        >>> str(ArgumentValueError("timeout", "a positive finite number", -1))
        '`timeout` should be a positive finite number, got -1.'
    """


def _num(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{_num(minimum)}, {_num(maximum)}]"
    if minimum is not None:
        return f" >= {_num(minimum)}"
    if maximum is not None:
        return f" <= {_num(maximum)}"
    return ""


def check_int(
    name: str,
    value: Any,
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    allow_none: bool = False,
    allowed_words: tuple[str, ...] = (),
) -> Any:
    """``value`` as an ``int`` in ``[minimum, maximum]`` (no ``bool``), or one of ``allowed_words`` (``"auto"``) as is.

    Example::

        >>> check_int("world_size", 4, 1)
        4
        >>> check_int("devices", 0, minimum=1)
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `devices` should be an integer >= 1, got 0.
    """
    words = [*map(repr, allowed_words), f"an integer{_bounds(minimum, maximum)}", *(["None"] if allow_none else [])]
    allowed = " or ".join(words)
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value in allowed_words:
        return value
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(name, allowed, value) from None
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ArgumentValueError(name, allowed, value)
    return value


def check_number(
    name: str,
    value: Any,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    allow_none: bool = False,
    what: str = "",
) -> Any:
    """``value`` when it is a finite real number within the bounds (not a ``bool``); ``what`` names its unit.

    Example::

        >>> check_number("timeout", float("inf"), 0, exclusive_minimum=True)
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `timeout` should be a positive finite number, got inf.
    """
    if minimum == 0 and exclusive_minimum and maximum is None:
        span = "a positive finite number"
    else:
        low = "" if minimum is None else f"{'>' if exclusive_minimum else '>='} {_num(minimum)}"
        high = "" if maximum is None else f"{'<' if exclusive_maximum else '<='} {_num(maximum)}"
        bounds = " and ".join(bound for bound in (low, high) if bound)
        span = f"a finite number {bounds}".rstrip()
    allowed = span + (f" of {what}" if what else "") + (" or None" if allow_none else "")
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(name, allowed, value)
    too_low = minimum is not None and (value <= minimum if exclusive_minimum else value < minimum)
    too_high = maximum is not None and (value >= maximum if exclusive_maximum else value > maximum)
    if not math.isfinite(value) or too_low or too_high:
        raise ArgumentValueError(name, allowed, value)
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` when it is ``True`` or ``False`` (not ``1``, ``"true"`` or ``None``).

    Example::

        >>> check_bool("static_graph", False)
        False
        >>> check_bool("static_graph", "maybe")
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentTypeError: `static_graph` should be True or False, got 'maybe'.
    """
    if not isinstance(value, bool):
        raise ArgumentTypeError(name, "True or False", value)
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value`` when it is one of ``choices`` (of the same type: ``1`` is not ``True``).

    Example::

        >>> check_choice("backend", "foo", ("gloo", "nccl"))
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `backend` should be one of 'gloo', 'nccl', got 'foo'.
    """
    choices = tuple(choices)
    if not any(value == choice and type(value) is type(choice) for choice in choices):
        raise ArgumentValueError(name, "one of " + ", ".join(repr(c) for c in choices), value)
    return value
