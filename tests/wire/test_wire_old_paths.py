"""The old top-level path of the KV-event contract still works for one release, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_prefixkv_kv_events_is_a_deprecated_alias_of_wire_kv_events() -> None:
    from prefixkv.wire import kv_events

    sys.modules.pop("prefixkv.kv_events", None)
    with pytest.warns(DeprecationWarning, match="prefixkv.wire.kv_events"):
        old = importlib.import_module("prefixkv.kv_events")
    assert old.block_hashes is kv_events.block_hashes
    assert old.decode_batch is kv_events.decode_batch
    assert set(old.__all__) == set(kv_events.__all__)
