"""The cache core's optional C helpers, built from ``_keypack.c`` and ``_evict.c`` by
``setup.py`` where a C compiler is present, or ``None``: every user keeps a Python path."""

from __future__ import annotations

__all__ = ["evict", "keypack"]

try:
    from prefixkv.cache import _keypack as keypack
except ImportError:  # no compiler at install time, or a source tree that was never built
    keypack = None  # type: ignore[assignment]

try:
    from prefixkv.cache import _evict as evict
except ImportError:
    evict = None  # type: ignore[assignment]
