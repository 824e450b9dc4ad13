"""RadixForest's shape: how a node's children are stored (radix.py, radix_node.py)."""

from __future__ import annotations

import pytest

from prefixkv.cache import RadixPrefixCache
from prefixkv.cache.radix_node import NO_CHILDREN


def test_radix_children_share_a_first_token_only_above_block_size_1(clock):
    """Childless nodes share one read-only mapping; a first token shared by two children (block
    size > 1: they differ inside their first block) maps to a tuple, back to the node alone
    when one of them goes."""
    cache = RadixPrefixCache(64, 2, clock=clock)
    cache.insert_prefix([1, 2, 3, 4], [0, 1])
    cache.insert_prefix([1, 9, 5, 6], [2, 3])
    root = next(iter(cache._forest._roots.values()))
    pair = root.children[1]
    assert isinstance(pair, tuple) and len(pair) == 2
    assert all(c.children is NO_CHILDREN for c in pair)
    with pytest.raises(TypeError):
        NO_CHILDREN[0] = pair[0]  # type: ignore[index]
    clock.advance()
    cache.match_prefix([1, 9, 5, 6])  # the second is now the more recent
    assert list(cache.evict(2)) == [1, 0]
    assert root.children[1] is pair[1]
    cache.insert_prefix([1, 9, 5, 6, 7, 8], [2, 3, 4])
    assert pair[1].children is not NO_CHILDREN and len(pair[1].children) == 1
    cache.check_invariants()
