"""Who counts as a local client of the admin routes: a peer on the loopback interface whose
request carries no proxy header. The server's and the router's admin rule; this module imports
nothing of prefixkv, so every layer may use it.

A reverse proxy on the same host connects from 127.0.0.1 for every remote user, so the peer
address alone proves nothing. Any header a proxy adds to name the original client, or itself,
makes a request *not local*: ``Forwarded`` and every name containing ``forwarded``
(``X-Forwarded-For`` / ``-Host`` / ``-Proto`` / ..., ``X-Original-Forwarded-For``), ``Via``,
every name ending in ``-ip`` and ``Client-IP`` (``X-Real-IP``, ``X-Client-IP``,
``CF-Connecting-IP``, ``True-Client-IP``, ``Fastly-Client-IP``, ``X-Cluster-Client-IP``), and
Envoy's ``X-Envoy-External-Address``. A proxy that adds none of them cannot be told from a local
client: behind one, set an admin key.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

__all__ = ["is_local_client", "proxy_header"]

_EXACT = frozenset({"via", "client-ip", "x-envoy-external-address"})


def proxy_header(names: Iterable[str]) -> str | None:
    """The first of the header ``names`` that a proxy sets (see the module docstring), or
    ``None``."""
    for name in names:
        low = name.lower()
        if low in _EXACT or "forwarded" in low or low.endswith("-ip"):
            return name
    return None


def is_local_client(host: str | None, header_names: Iterable[str]) -> bool:
    """Whether a request from peer address ``host`` with headers ``header_names`` is a direct
    client on the loopback interface (no proxy header)."""
    if proxy_header(header_names) is not None:
        return False
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return host == "localhost"
