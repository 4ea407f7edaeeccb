"""Argument checks
===============

The validators every class and function of the pack uses: a wrong type raises
:class:`ArgumentTypeError`, a wrong value :class:`ArgumentValueError`, both naming the argument.
"""

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

    ``problem`` says what is wrong in a few words ("got 'foo'" unless given). The message reads
    "`<argument>` should be <allowed>, got <got>." plus an optional ``hint``. A caller that knows
    where the argument came from (the training app knows the config key) restates it in its own words.

    Example::

        >>> try:
        ...     check_int("devices", 0, 1)
        ... except ArgumentError as err:
        ...     print(err.argument, "|", err.problem, "|", err.allowed)
        devices | got 0 | an integer >= 1
    """

    def __init__(self, argument: str, allowed: str, got: Any = _UNSET, *, problem: str | None = None, hint: str = ""):
        self.argument = argument
        self.allowed = allowed
        self.got = got
        self.problem = problem if problem is not None else f"got {got!r}"
        self.hint = hint
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


def _is_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


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
    """``value`` as an ``int`` when it is an integer in ``[minimum, maximum]`` (``bool`` is not an integer),
    or one of ``allowed_words`` (such as ``"auto"``) as it is.

    Raises:
        ArgumentTypeError: not an integer (nor ``None`` when ``allow_none``, nor one of ``allowed_words``).
        ArgumentValueError: outside the bounds.

    Example::

        >>> check_int("world_size", 4, 1)
        4
        >>> check_int("devices", 0, minimum=1)
        Traceback (most recent call last):
        ...
        ddp_plugins.core.checks.ArgumentValueError: `devices` should be an integer >= 1, got 0.
    """
    allowed = " or ".join([*map(repr, allowed_words), f"an integer{_bounds(minimum, maximum)}"]) + (
        " or None" if allow_none else ""
    )
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value in allowed_words:
        return value
    if not _is_int(value):
        raise ArgumentTypeError(name, allowed, value)
    value = operator.index(value)
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
    """``value`` when it is a finite real number within the bounds (``bool`` is not a number).

    Args:
        name: the argument's name, for the message.
        value: what was received.
        minimum: the lowest allowed value (``exclusive_minimum``: the value must be above it).
        maximum: the highest allowed value (``exclusive_maximum``: the value must be below it).
        allow_none: ``None`` is allowed too.
        what: a word for the unit or meaning, e.g. ``"seconds"``, in the message.

    Raises:
        ArgumentTypeError: not a real number (nor ``None`` when ``allow_none``).
        ArgumentValueError: NaN, infinite, or outside the bounds.

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
        span = (
            "a finite number"
            + (f" {low}" if low else "")
            + (" and" if low and high else "")
            + (f" {high}" if high else "")
        )
    allowed = span + (f" of {what}" if what else "") + (" or None" if allow_none else "")
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(name, allowed, value)
    if not math.isfinite(value):
        raise ArgumentValueError(name, allowed, value)
    too_low = minimum is not None and (value <= minimum if exclusive_minimum else value < minimum)
    too_high = maximum is not None and (value >= maximum if exclusive_maximum else value > maximum)
    if too_low or too_high:
        raise ArgumentValueError(name, allowed, value)
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` when it is ``True`` or ``False``.

    Raises:
        ArgumentTypeError: anything else (``1``, ``"true"``, ``None``).

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
    """``value`` when it is one of ``choices``.

    Raises:
        ArgumentValueError: ``value`` is not among them (the message lists them).

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
