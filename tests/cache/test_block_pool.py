"""BlockPool: ids, free order, errors."""

from __future__ import annotations

import pytest

from prefixkv.cache import BlockPool, RadixPrefixCache


def test_allocate_and_free_in_order():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    pool.free([2, 0])
    assert pool.allocate(3) == [3, 2, 0]
    assert pool.allocate(1) is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)


def test_bad_free_changes_nothing():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    with pytest.raises(ValueError, match="out of range"):
        pool.free([ids[0], 9])
    with pytest.raises(ValueError, match="double free"):
        pool.free([ids[0], ids[0]])
    assert pool.num_free == 2 and not pool.is_free(ids[0])
    with pytest.raises(ValueError, match="non-negative"):
        pool.allocate(-1)


def test_allocate_evicts_only_what_it_needs():
    pool = BlockPool(6)
    cache = RadixPrefixCache(6, 1)
    cache.insert_prefix([1, 2, 3, 4], pool.allocate(4))
    assert pool.allocate(4, evict_from=cache) is not None
    assert cache.num_cached_blocks == 2
