"""Token-id inputs: every accepted container behaves like a list; bad ones are clear errors.

Mirrors ``prefixkv/cache/_checks.py`` (``as_token_array`` / ``as_token_list``).
"""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from prefixkv.cache._checks import as_token_array, as_token_list
from prefixkv.cache._native import keypack

TOKS = [5, 0, 149_999, 2**32 - 1, 7, 7, 3, 1]


def _forms(toks):
    yield "list", list(toks)
    yield "tuple", tuple(toks)
    for code in ("I", "q", "Q", "L", "l"):
        yield f"array-{code}", array(code, toks)
    for dt in (np.uint32, np.int64, np.uint64):
        yield f"numpy-{np.dtype(dt).name}", np.array(toks, dtype=dt)
    yield "numpy-strided", np.array([t for t in toks for _ in (0, 1)], dtype=np.int64)[::2]


@pytest.mark.parametrize("name", [n for n, _ in _forms(TOKS)])
def test_every_form_converts_to_the_same_array(name):
    value = dict(_forms(TOKS))[name]
    got = as_token_array(value)
    assert got.typecode == "I" and got.tolist() == TOKS
    assert list(as_token_list(value)) == TOKS


@pytest.mark.parametrize("name", [n for n, _ in _forms(TOKS)])
def test_narrow_packs_two_bytes_only_when_every_id_fits(name):
    small = [t % 65536 for t in TOKS]
    got = as_token_array(dict(_forms(small))[name], narrow=True)
    assert got.typecode == "H" and got.tolist() == small
    wide = as_token_array(dict(_forms(TOKS))[name], narrow=True)  # 149,999 needs 4 bytes
    assert wide.typecode == "I" and wide.tolist() == TOKS
    h = array("H", small)
    assert as_token_array(h, narrow=True) is h and as_token_array(h).typecode == "I"
    with pytest.raises(ValueError, match="non-negative"):
        as_token_array(np.array([1, -1]), narrow=True)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        as_token_array([1, 2**32], narrow=True)


def test_array_I_is_returned_as_is():
    a = array("I", TOKS)
    assert as_token_array(a) is a


def test_small_int_dtypes():
    for dt in (np.int8, np.uint8, np.int16, np.uint16, np.int32):
        assert as_token_array(np.array([1, 2, 3], dtype=dt)).tolist() == [1, 2, 3]
    assert as_token_array(array("h", [4, 5])).tolist() == [4, 5]
    assert as_token_array(range(3)).tolist() == [0, 1, 2]
    assert as_token_array(np.array([], dtype=np.int64)).tolist() == []


@pytest.mark.parametrize(("value", "msg"), [
    (array("q", [1, -2]), "non-negative, found -2"),
    (np.array([3, 2**32], dtype=np.int64), "< 2\\*\\*32, found 4294967296"),
    (np.array([1.0, 2.0]), "ints, got dtype float64"),
    (np.array([True, False]), "ints, got dtype bool"),
    (np.zeros((2, 2), dtype=np.int64), "1-D"),
    (array("d", [1.0]), "ints, got array\\('d'\\)"),
    ([1, -1], "non-negative"),
    ([1, 2**33], "< 2\\*\\*32"),
    ([1, "x"], "ints"),
    ("abc", "sequence of ints"),
    (None, "sequence of ints"),
    (5, "sequence of ints"),
])
def test_bad_inputs_name_the_argument(value, msg):
    with pytest.raises(ValueError, match=msg):
        as_token_array(value, "token_ids")


def test_generic_iterables_and_tolist_objects():
    class Seq:
        def __iter__(self):
            return iter([1, 2])

    assert as_token_array(Seq()).tolist() == [1, 2]
    assert as_token_list(Seq()) == [1, 2]


def test_cpu_torch_tensors_by_duck_typing(make):
    torch = pytest.importorskip("torch")
    toks = list(range(10, 10 + 3 * make.bs))
    cache = make()
    cache.insert_prefix(torch.tensor(toks, dtype=torch.int64), [1, 2, 3])
    for t in (torch.tensor(toks), torch.tensor(toks, dtype=torch.int32),
              torch.tensor(toks + [0, 0])[: len(toks)]):
        m = cache.match_prefix(t)
        assert list(m.matched_kv_blocks) == [1, 2, 3] and m.matched_tokens == toks
    with pytest.raises(ValueError, match="non-negative"):
        cache.match_prefix(torch.tensor([-1] * make.bs))
    with pytest.raises(ValueError, match="ints"):
        cache.match_prefix(torch.tensor([1.5] * make.bs))
    needs_grad = torch.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(ValueError, match="token_ids"):
        as_token_array(needs_grad)


def test_numpy_and_array_q_queries_match_like_lists(make):
    bs = make.bs
    cache = make()
    toks = list(range(20, 20 + 3 * bs))
    cache.insert_prefix(np.array(toks, dtype=np.int64), [4, 5, 6])
    for q in (np.array(toks, dtype=np.uint32), array("q", toks), np.array(toks + [9])):
        m = cache.match_prefix(q)
        assert list(m.matched_kv_blocks) == [4, 5, 6] and m.matched_tokens == toks
        assert all(type(t) is int for t in m.matched_tokens)
    assert cache.pin_prefix(np.array(toks)) and cache.unpin_prefix(array("q", toks))


def test_radix_keys_widen_once_on_the_first_large_id():
    """A radix tree keeps 2-byte keys until an id >= 2**16 is inserted, then widens every key;
    matches before and after (and queries holding large ids against narrow keys) agree."""
    from prefixkv.cache import RadixPrefixCache
    from prefixkv.cache.radix_node import PACKED

    for bs in (1, 4):
        cache = RadixPrefixCache(64, bs)
        a = list(range(100, 100 + 4 * bs))
        big = a[: 2 * bs] + [70_000 + i for i in range(2 * bs)]
        cache.insert_prefix(a, list(range(4)))
        assert cache._forest.key_typecode == "H"
        m = cache.match_prefix(big)  # an array('I') query against 2-byte keys
        assert m.match_length == 2 * bs and list(m.matched_kv_blocks) == [0, 1]
        node = cache.insert_prefix(big + [80_000] * (bs - 1), [0, 1, 10, 11])
        assert list(node.kv_block_ids) == [0, 1, 10, 11]
        assert cache._forest.key_typecode == ("P" if PACKED and bs % 4 == 0 else "I")
        cache.check_invariants()
        for q in (a, array("q", a), np.array(big), big):
            assert cache.match_prefix(q).match_length == 4 * bs
        assert cache.get_stats().memory_bytes > 0
        assert sorted(cache.evict(8)) == [0, 1, 2, 3, 10, 11]


@pytest.mark.parametrize("value", [
    array("q", [2**32]), array("q", [-1, 5]), np.array([7, -3], dtype=np.int64),
    np.array([2**63 + 1, 1], dtype=np.uint64), array("Q", [2**40]),
])
@pytest.mark.parametrize("narrow", [False, True])
def test_int64_inputs_out_of_range_fail_in_both_key_widths(value, narrow):
    """64-bit inputs are checked by one maximum over their uint64 view: a negative reads as
    >= 2**63, so it fails like an id >= 2**32, for 2- and 4-byte keys alike."""
    with pytest.raises(ValueError, match="token_ids must be (non-negative|< 2)"):
        as_token_array(value, "token_ids", narrow=narrow)


def test_int64_and_list_inputs_convert_the_same_without_the_c_helper(monkeypatch):
    """array('q'), numpy int64 and list/tuple queries go through one C pass when the helper is
    built, else through numpy or ``array``: the same arrays and the same errors either way."""
    from prefixkv.cache import _checks

    cases = [array("q", [1, 2, 3]), array("q", [1, 70_000]), np.array([5, 2**32 - 1]),
             array("q", [1, -1]), array("q", [2**32]), np.array([-3, 4]),
             [1, 2, 3], (1, 70_000), [], [True, 2**32 - 1], [np.int64(3), 4], [1, -1],
             [2**32], [1, "a"], [2.0], [2**70]]

    def convert(x, narrow):
        try:
            got = _checks.as_token_array(x, narrow=narrow)
            return got.typecode, list(got)
        except ValueError as exc:
            return str(exc)

    with_c = [convert(x, n) for x in cases for n in (False, True)]
    monkeypatch.setattr(_checks, "_keypack", None)
    assert [convert(x, n) for x in cases for n in (False, True)] == with_c
    assert with_c[1] == ("H", [1, 2, 3]) and with_c[2] == ("I", [1, 70_000])
    assert "non-negative" in with_c[6] and "2**32" in with_c[8]
    assert with_c[13] == ("H", [1, 2, 3]) and with_c[14] == ("I", [1, 70_000])
    assert with_c[19] == ("I", [1, 2**32 - 1]) and with_c[21] == ("H", [3, 4])
    assert "ints" in with_c[26] and "ints" in with_c[28]


def test_exact_ids_below_takes_only_plain_ints_in_range(monkeypatch):
    """The engine's prompt check: exactly ``int`` (a bool or an IntEnum member is another
    type to it), in ``[0, limit)``; ``None`` when the C helper is not built."""
    import enum

    from prefixkv.cache import _checks

    class Tok(enum.IntEnum):
        A = 3

    if _checks._keypack is not None:
        assert _checks.exact_ids_below([], 5) is True
        assert _checks.exact_ids_below([0, 4, 4, 1], 5) is True
        for bad in ([5], [0, -1], [True], [Tok.A], [np.int64(3)], [2.0], [2**32], [2**70], ["a"]):
            assert _checks.exact_ids_below(bad, 5) is False, bad
        assert _checks.exact_ids_below([2**32 - 1], 2**32) is True
    monkeypatch.setattr(_checks, "_keypack", None)
    assert _checks.exact_ids_below([1, 2], 5) is None


@pytest.mark.skipif(keypack is None, reason="the C helper prefixkv.cache._keypack is not built")
def test_from_list_reads_every_int_size_as_array_does():
    """The C list reader takes small ints from their digits and others the general way: both
    give ``array('I')``'s values, and ``None`` (the caller's checked path) where it would fail
    (negative, 2**32 and up, a bool or subclass when ``exact``)."""
    k = keypack
    edges = [0, 1, 2**15, 2**16 - 1, 2**16, 2**30 - 1, 2**30, 2**31, 2**32 - 1, 2**32, 2**33,
             2**60, 2**70, -1, -(2**30), -(2**31), -(2**60), True, False]
    for v in edges:
        want = array("I", [int(v)]).tobytes() if 0 <= v < 2**32 else None
        assert k.from_list([7, v], False) == (None if want is None else array("I", [7]).tobytes() + want), v
        assert k.from_list((v,), False, True) == (None if type(v) is bool else want), v
    many = [(i * 2654435761) % 2**32 for i in range(5000)]  # every digit count below 2**32
    assert k.from_list(many, False) == array("I", many).tobytes()
    assert k.from_list(many[:300], True) == array("I", many[:300]).tobytes()  # some >= 2**16
    small = [i % 65536 for i in range(70_000)]
    assert k.from_list(small, True) == array("H", small).tobytes()
