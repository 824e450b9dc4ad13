"""The cache core's optional C helper, ``prefixkv.cache._keypack`` (built from ``_keypack.c``
by ``setup.py`` where a C compiler is present), or ``None``: every user keeps a Python path."""

from __future__ import annotations

__all__ = ["keypack"]

try:
    from prefixkv.cache import _keypack as keypack
except ImportError:  # no compiler at install time, or a source tree that was never built
    keypack = None  # type: ignore[assignment]
