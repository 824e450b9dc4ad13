"""PinRegistry through the indexes: pins are named by namespace, extra keys and tokens."""

from __future__ import annotations

import pytest

from prefixkv.cache import HashPrefixCache, PinError, RadixPrefixCache


def test_pins_with_different_extra_keys_are_different_pins() -> None:
    cache = HashPrefixCache(64, 4, max_pinned_blocks=8)
    toks = list(range(8))
    cache.insert_prefix(toks, [0, 1], extra_keys=["a", "a"])
    cache.insert_prefix(toks, [2, 3], extra_keys=["b", "b"])
    with pytest.raises(PinError, match="not cached"):
        cache.pin(toks)  # no extra keys: another prefix, not cached
    first = cache.pin(toks, extra_keys=["a", "a"], description="image a")
    second = cache.pin(toks, extra_keys=["b", "b"])
    assert first.extra_keys == ["a", "a"] and second.extra_keys == ["b", "b"]
    assert cache.pin(toks, extra_keys=["a", "a"]) is first  # pinning again: the same record
    assert cache.get_stats().pinned_blocks == 4 and len(cache.list_pinned()) == 2
    assert list(cache.evict(4)) == []
    assert not cache.unpin_prefix(toks)  # not pinned without extra keys
    assert cache.unpin_prefix(toks, extra_keys=["a", "a"])
    assert sorted(cache.evict(4)) == [0, 1]  # only the unpinned prefix goes
    cache.check_invariants()


def test_insert_with_pin_pins_the_prefix_with_its_extra_keys() -> None:
    cache = HashPrefixCache(64, 4, max_pinned_blocks=8)
    node = cache.insert_prefix(list(range(8)), [0, 1], pin=True, extra_keys=[1, 2])
    assert node.is_pinned and cache.list_pinned()[0].extra_keys == [1, 2]
    assert cache.unpin_prefix(list(range(8)), extra_keys=[1, 2])
    # a trailing partial block's extra key (one more than the full blocks) is not part of the pin
    node = cache.insert_prefix(list(range(20, 30)), [4, 5], pin=True, extra_keys=["x", "y", "z"])
    assert node.is_pinned and cache.list_pinned()[0].extra_keys == ["x", "y"]
    cache.check_invariants()


def test_unhashable_extra_keys_on_unpin_are_a_value_error() -> None:
    cache = HashPrefixCache(64, 4)
    with pytest.raises(ValueError, match="hashable"):
        cache.unpin_prefix(list(range(8)), extra_keys=[[1], [2]])


def test_the_budget_is_checked_before_anything_changes() -> None:
    cache = RadixPrefixCache(64, 2, max_pinned_blocks=3)
    cache.insert_prefix(list(range(8)), [0, 1, 2, 3])
    with pytest.raises(PinError, match="max_pinned_blocks=3"):
        cache.pin(list(range(8)))
    assert cache.list_pinned() == [] and cache.get_stats().pinned_blocks == 0
    assert cache.pin(list(range(6))).num_blocks == 3
    cache.check_invariants()
