"""Network presets into the environment, gloo on loopback; see docs/design.md, "Which interfaces listen (one node)"."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Mapping
from typing import Any

__all__ = ["apply_network_env", "pin_gloo_to_loopback", "restore_env"]


def apply_network_env(env: Mapping[str, Any] | None) -> dict[str, str]:
    """Set a network preset's variables in ``os.environ`` (a user's value is kept; child ranks inherit them).

    Returns:
        The effective value of every variable the preset names.

    Example::

        >>> os.environ["EXAMPLE_TIMEOUT"] = "5"
        >>> apply_network_env({"EXAMPLE_TIMEOUT": 22, "EXAMPLE_RETRY": 7})
        {'EXAMPLE_TIMEOUT': '5', 'EXAMPLE_RETRY': '7'}
    """
    return {str(key): os.environ.setdefault(str(key), str(value)) for key, value in (env or {}).items()}


def restore_env(before: Mapping[str, str]) -> None:
    """Make ``os.environ`` equal ``before`` again: added variables removed, changed ones restored.

    Example::

        >>> before = dict(os.environ)
        >>> os.environ["EXAMPLE_ADDED"] = "1"
        >>> restore_env(before)
        >>> "EXAMPLE_ADDED" in os.environ
        False
    """
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)


def pin_gloo_to_loopback(main_address: str) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to loopback for a loopback ``main_address``, unless set; return what was set."""
    if "GLOO_SOCKET_IFNAME" in os.environ or not is_loopback(main_address):
        return None
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    loopback = next((name for name in ("lo", "lo0") if name in names), None)  # Linux's, macOS's
    if loopback is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    return loopback


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP or a host name) is a loopback address of this machine."""
    with contextlib.suppress(ValueError):  # a host name
        return ipaddress.ip_address(address).is_loopback
    try:
        infos = socket.getaddrinfo(address, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)
