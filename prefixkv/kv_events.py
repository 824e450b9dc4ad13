"""Deprecated path of :mod:`prefixkv.wire.kv_events` (moved in 0.2; this alias goes in the next release)."""

from __future__ import annotations

import warnings

from prefixkv.wire.kv_events import *  # noqa: F403  (the documented names, re-exported)
from prefixkv.wire.kv_events import __all__  # noqa: F401

warnings.warn("prefixkv.kv_events moved to prefixkv.wire.kv_events; the old path goes in the "
              "next release", DeprecationWarning, stacklevel=2)
