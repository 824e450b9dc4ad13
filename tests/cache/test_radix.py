"""RadixForest's shape: how a node's children are stored (radix.py, radix_node.py)."""

from __future__ import annotations

from array import array

import pytest

from prefixkv.cache import RadixPrefixCache
from prefixkv.cache.radix_node import (
    NO_CHILDREN,
    PACKED,
    common_packed_blocks,
    first_token,
    key_tokens,
    pack,
    packed_len,
)


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


needs_packing = pytest.mark.skipif(not PACKED, reason="the C helper prefixkv.cache._keypack is not built")


@needs_packing
def test_packed_keys_round_trip_and_compare_as_bytes():
    """18-bit packing is a bijection on groups of four: unpacking gives the ids back, a larger id
    ends the packed run at its group, and common byte prefixes are whole groups."""
    ids = array("I", [0, 1, 2**18 - 1, 150_000, 7, 65_536, 131_071, 3])
    packed = pack(ids, 0, 8)
    assert len(packed) == 18 and packed_len(packed) == 8
    assert list(key_tokens(packed)) == list(ids) and list(key_tokens(packed, 3, 6)) == [150_000, 7, 65_536]
    assert first_token(packed) == 0 and first_token(pack(ids, 4, 8)) == 7
    assert pack(array("H", [1, 2, 3, 4, 5]), 0, 5) == pack(array("I", [1, 2, 3, 4]), 0, 4)
    assert pack(array("I", [1, 2, 3, 4, 5, 6, 2**18, 8]), 0, 8) == pack(ids[:0] + array("I", [1, 2, 3, 4]), 0, 4)
    other = pack(array("I", [0, 1, 2**18 - 1, 150_000, 7, 65_536, 131_071, 4]), 0, 8)
    assert common_packed_blocks(packed, 0, other, 9) == 1 and common_packed_blocks(packed, 0, packed, 9) == 2
    # 64-bit ids (a query as SGLang passes it) pack the same; a negative one stops the run
    assert pack(array("q", ids), 0, 8) == packed  # type: ignore[arg-type]
    assert pack(array("q", [1, 2, 3, 4, -1, 5, 6, 7]), 0, 8) == pack(array("I", [1, 2, 3, 4]), 0, 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pack(array("i", [1, 2, 3, 4]), 0, 4)  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        pack(ids, 0, 9)


@needs_packing
def test_packed_tree_matches_splits_evicts_and_widens(clock):
    """A 150k-vocabulary tree at block size 4 keeps 2.25 bytes a token: matches (whole blocks
    and partial rows), splits, tail trims, siblings sharing a first token, queries holding ids
    no key can hold, and the widening to 4 bytes at the first id >= 2**18 all agree with the
    tokens."""
    bs = 4
    cache = RadixPrefixCache(256, bs, clock=clock)
    a = [100_000 + 7 * i for i in range(32)]
    cache.insert_prefix(a, list(range(8)))
    forest = cache._forest
    assert forest.key_typecode == "P"
    assert forest.memory_bytes() < 8 * 4 * 4 + 800  # 2.25 bytes a token plus one node
    b = a[:13] + [5, 6, 7] + [149_999] * 8  # leaves `a` inside its 4th block (3 rows shared)
    m = cache.match_prefix(b)
    assert m.match_length == 12 and m.partial_tokens == 1
    cache.insert_prefix(b, list(range(100, 106)))  # splits a's node after 3 blocks
    cache.check_invariants()
    assert cache.match_prefix(a).match_length == 32 and cache.match_prefix(b).match_length == 24
    sibling = a[:12] + [a[12], 9, 9, 9]  # same first token as both children of the split
    cache.insert_prefix(sibling, [0, 1, 2, 200])
    cache.check_invariants()
    assert list(cache.match_prefix(sibling).matched_kv_blocks) == [0, 1, 2, 200]
    assert cache.match_prefix(a[:10] + [2**20] * 6).match_length == 8  # no key holds 2**20
    clock.advance()
    cache.match_prefix(b)
    cache.match_prefix(sibling)
    assert list(cache.evict(2)) == [7, 6]  # a's tail, deepest first, trimmed in place
    cache.check_invariants()
    assert cache.match_prefix(a).match_length == 24
    cache.insert_prefix(a[:8] + [2**18] * 4, [0, 1, 50])  # widens every key
    assert forest.key_typecode == "I"
    cache.check_invariants()
    for q, n in ((a, 24), (b, 24), (sibling, 16), (a[:8] + [2**18] * 4, 12)):
        assert cache.match_prefix(q).match_length == n


@needs_packing
def test_int64_queries_walk_a_packed_tree_as_they_are(clock):
    """A packed tree walks an ``array('q')`` query straight from its buffer (no narrowed copy):
    every match (whole blocks, partial rows, ids no key holds, siblings) equals the list query's,
    the match keeps the caller's array, and out-of-range values still fail by name."""
    bs = 4
    cache = RadixPrefixCache(256, bs, clock=clock)
    a = [100_000 + 7 * i for i in range(32)]
    b = a[:13] + [5, 6, 7] + [149_999] * 8
    cache.insert_prefix(a, list(range(8)))
    cache.insert_prefix(b, list(range(100, 106)))
    cache.insert_prefix(a[:12] + [a[12], 9, 9, 9], [0, 1, 2, 200])
    assert cache._forest.key_typecode == "P"
    queries = [a, b, a[:13] + [5, 6], a[:10] + [2**20] * 6, a[:12] + [a[12], 9, 9, 9, 1],
               a[:6] + [2**31 + 5] * 6, [7] * 9, a[:3], []]
    for q in queries:
        want, got = cache.match_prefix(q), cache.match_prefix(array("q", q))
        assert (list(got.matched_kv_blocks), got.match_length, got.partial_tokens,
                got.partial_block_id) == (list(want.matched_kv_blocks), want.match_length,
                                          want.partial_tokens, want.partial_block_id)
    q = array("q", a)
    assert cache.match_prefix(q).token_ids is q
    for q in (b, a[:13] + [5, 6]):  # whole blocks; whole blocks and a partial one
        locked = []
        for form in (q, array("q", q)):
            held = cache.match_prefix(form, lock=True)
            locked.append(cache.get_stats().locked_blocks)
            cache.unlock(held)
        assert locked[0] == locked[1] > 0
    for bad in (array("q", a[:8] + [-1]), array("q", a[:8] + [2**32])):
        with pytest.raises(ValueError, match="token_ids"):
            cache.match_prefix(bad)
    cache.check_invariants()


def test_the_c_helper_is_built_where_a_compiler_is(c_compiler: None) -> None:
    """`pip install -e .` builds prefixkv.cache._keypack when a C compiler is present (the
    build is optional, so a failed one would otherwise pass unnoticed and cost 2 KB a prefix)."""
    assert PACKED, "the C helper was not built: run `pip install -e .` (needs the Python headers)"


@needs_packing
def test_packing_helpers_match_a_python_reference():
    """pack18 / unpack18 / common_bytes against plain-Python references on random ids (uint16
    and uint32 buffers, ids at and past 2**18, every start/stop), so the C code cannot drift."""
    import random

    from prefixkv.cache import _keypack

    def ref_pack(ids: list[int]) -> bytes:
        out = bytearray()
        for g in range(len(ids) // 4):
            t = ids[4 * g : 4 * g + 4]
            if max(t) >= 1 << 18:
                break
            out += (t[0] | t[1] << 18 | t[2] << 36 | t[3] << 54).to_bytes(9, "little")
        return bytes(out)

    rng = random.Random(1)
    for _ in range(3000):
        code = rng.choice("IHq")
        top = 1 << 16 if code == "H" else rng.choice([1 << 18, (1 << 18) + 10, 1 << 32])
        ids = array(code, [rng.randrange(top) if rng.random() < 0.97 else top - 1
                           for _ in range(rng.randrange(40))])
        assert _keypack.fits32(array("q", ids)) == (not ids or max(ids) < 1 << 32)
        s = rng.randrange(len(ids) + 1)
        e = rng.randrange(s, len(ids) + 1)
        packed = _keypack.pack18(ids, s, e)
        assert packed == ref_pack(list(ids[s:e]))
        m = packed_len(packed)
        a = rng.randrange(m + 1)
        b = rng.randrange(a, m + 1)
        assert list(key_tokens(packed, a, b)) == list(ids[s + a : s + b])
        x = bytes(rng.randrange(3) for _ in range(rng.randrange(20)))
        y = bytes(rng.randrange(3) for _ in range(rng.randrange(20)))
        xo, yo, limit = rng.randrange(len(x) + 2), rng.randrange(len(y) + 2), rng.randrange(25)
        n = 0
        if xo <= len(x) and yo <= len(y):
            while n < limit and xo + n < len(x) and yo + n < len(y) and x[xo + n] == y[yo + n]:
                n += 1
        assert _keypack.common_bytes(x, xo, y, yo, limit) == n
