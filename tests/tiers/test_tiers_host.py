from __future__ import annotations

import pytest

from prefixkv.tiers.host import HostTier


def test_lru_and_holds() -> None:
    h = HostTier(2)
    a, b, c = b"a", b"b", b"c"
    sa, sb = h.reserve(a), h.reserve(b)
    assert {sa, sb} == {0, 1} and len(h) == 2
    assert h.reserve(a) is None  # already stored (and now most recent)
    sc = h.reserve(c)  # evicts b, the least recently used
    assert sc == sb and b not in h and a in h and c in h
    assert h.counters.get("evictions") == 1
    assert h.hold(a) == sa and h.hold(c) == sc
    assert h.reserve(b"d") is None  # everything held: the new block is dropped
    assert h.counters.get("dropped") == 1
    h.release(a)
    assert h.reserve(b"d") == sa and a not in h
    assert h.hold(b"zz") is None
    assert h.clear() == 1 and c in h  # held c stays
    h.release(c)
    assert h.clear() == 1 and len(h) == 0
    with pytest.raises(ValueError, match="kv_offload_size"):
        HostTier(0)
