"""HeldIds: short (Python) and bulk (numpy) claims and releases agree, and bad ids change nothing."""

from __future__ import annotations

from array import array

import pytest

from prefixkv.cache.held_ids import BULK, MAX_BLOCKS, HeldIds, new_ids


def claim(h: HeldIds, ids, cached=(), stop=None):
    """Pack (as the index does) then claim."""
    packed = h.pack(ids)
    return h.claim(packed, array("I", cached), len(packed) if stop is None else stop)


@pytest.mark.parametrize("n", [3, BULK, 5 * BULK])
@pytest.mark.parametrize("order", ["down", "scattered"])
def test_claim_release_roundtrip(n, order):
    h = HeldIds(10 * BULK)
    ids = list(range(7, 7 + n))[::-1]
    if order == "scattered":
        ids[0], ids[-1] = ids[-1], ids[0]
    returned, taken = claim(h, ids)
    assert returned == [] and h.count == n and all(b in h for b in ids)
    assert type(taken) is array and list(taken) == ids
    h.release(taken[:2])
    h.release(taken[2:])
    assert h.count == 0 and h.as_set() == set()


@pytest.mark.parametrize("n", [5, 2 * BULK])
@pytest.mark.parametrize(("bad", "msg"), [
    ("dup", "repeated"),
    ("held", "already cached"),
    ("high", "out of range"),
    ("negative", "out of range"),
    ("float", "ints"),
    ("bool", "ints"),
])
def test_bad_claims_mark_nothing(n, bad, msg):
    h = HeldIds(4 * BULK)
    claim(h, [4 * BULK - 1])
    ids = list(range(n))
    if bad == "dup":
        ids[-1] = ids[1]
    elif bad == "held":
        ids[n // 2] = 4 * BULK - 1
    elif bad == "high":
        ids[n // 2] = 4 * BULK
    elif bad == "negative":
        ids[n // 2] = -1
    elif bad == "float":
        ids[0] = 0.0
    else:  # a bool at either end is caught when packing
        ids[0] = True
        ids[1] = n + 10
    with pytest.raises(ValueError, match=msg):
        claim(h, ids)
    assert h.count == 1 and h.as_set() == {4 * BULK - 1}


def test_returned_ids_are_checked_too():
    h = HeldIds(200)
    claim(h, list(range(100)))
    ids = [0, 1, 150] + list(range(101, 101 + BULK))
    returned, _ = claim(h, ids, [0, 1, 2])  # position 2 is cached under id 2
    assert returned == [150] and all(b in h for b in range(101, 101 + BULK))
    assert 150 not in h


def test_ids_past_stop_are_returned_and_not_held():
    h = HeldIds(100)
    returned, taken = claim(h, [5, 6, 7, 8], stop=2)
    assert returned == [7, 8] and list(taken) == [5, 6] and 7 not in h and h.count == 2


def test_pack_takes_uint32_arrays_as_is_and_rejects_wide_spaces():
    h = HeldIds(10)
    a = array("I", [1, 2])
    assert h.pack(a) is a and h.pack((1, 2)) == a and h.pack(new_ids()) == new_ids()
    with pytest.raises(ValueError, match="2\\*\\*32"):
        HeldIds(MAX_BLOCKS + 1)


def test_a_run_over_a_held_id_marks_nothing():
    h = HeldIds(1000)
    claim(h, [150])
    with pytest.raises(ValueError, match="block id 150"):
        claim(h, list(range(100, 100 + 2 * BULK)))
    with pytest.raises(ValueError, match="out of range"):
        claim(h, list(range(990, 990 + BULK)))
    assert h.as_set() == {150}
