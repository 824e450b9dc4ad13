"""Fixtures shared by the cache tests: a controllable clock and one factory per index kind."""

from __future__ import annotations

import pytest

from prefixkv.cache import HashPrefixCache, RadixPrefixCache


class FakeClock:
    """A clock the test advances by hand (no sleeping)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float = 1.0) -> float:
        self.now += dt
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# (index kind, block size) pairs the shared contract suite runs against
KINDS = [("radix", 1), ("radix", 4), ("hash", 4), ("hash", 1)]


@pytest.fixture(params=KINDS, ids=[f"{k}-bs{b}" for k, b in KINDS])
def make(request, clock):
    kind, bs = request.param

    def factory(max_blocks: int = 64, **kw):
        kw.setdefault("clock", clock)
        if kind == "radix":
            return RadixPrefixCache(max_blocks, bs, **kw)
        return HashPrefixCache(max_blocks, bs, **kw)

    factory.kind = kind
    factory.bs = bs
    return factory
