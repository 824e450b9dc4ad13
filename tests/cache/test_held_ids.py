"""HeldIds: short (Python) and bulk (numpy) claims and releases agree, and bad ids change nothing."""

from __future__ import annotations

import pytest

from prefixkv.cache.held_ids import BULK, HeldIds


@pytest.mark.parametrize("n", [3, BULK, 5 * BULK])
def test_claim_release_roundtrip(n):
    h = HeldIds(10 * BULK)
    ids = list(range(7, 7 + n))[::-1]
    returned, packed = h.claim(ids, [], n)
    assert returned == [] and h.count == n and all(b in h for b in ids)
    assert (packed is not None) == (n >= BULK)
    if packed is not None:
        assert list(packed) == ids and type(packed) is range  # a descending run
    h.release(ids[:2], None if packed is None else packed[:2])
    h.release(ids[2:], None if packed is None else packed[2:])
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
    h.claim([4 * BULK - 1], [], 1)
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
    else:  # the smallest and the first id: both paths check the extremes' types
        ids[0] = True
        ids[1] = n + 10
    with pytest.raises(ValueError, match=msg):
        h.claim(ids, [], n)
    assert h.count == 1 and h.as_set() == {4 * BULK - 1}


def test_returned_ids_are_checked_too():
    h = HeldIds(200)
    h.claim(list(range(100)), [], 100)
    ids = [0, 1, 150] + list(range(101, 101 + BULK))
    returned, _ = h.claim(ids, [0, 1, 2], len(ids))  # position 2 is cached under id 2
    assert returned == [150] and all(b in h for b in range(101, 101 + BULK))
    assert 150 not in h


@pytest.mark.parametrize("order", ["up", "down", "scattered"])
def test_runs_are_kept_as_ranges_and_release_in_parts(order):
    h = HeldIds(1000)
    ids = list(range(100, 100 + 2 * BULK))
    if order == "down":
        ids.reverse()
    elif order == "scattered":
        ids[3], ids[7] = ids[7], ids[3]
    _, packed = h.claim(ids, [], len(ids))
    assert list(packed) == ids
    assert (type(packed) is range) == (order != "scattered")
    h.release(ids[-5:], packed[-5:])
    assert h.count == len(ids) - 5 and all(b in h for b in ids[:-5])
    assert not any(b in h for b in ids[-5:])
    h.release(ids[:-5], packed[:-5])
    assert h.count == 0 and h.as_set() == set()


def test_a_run_over_a_held_id_marks_nothing():
    h = HeldIds(1000)
    h.claim([150], [], 1)
    with pytest.raises(ValueError, match="block id 150"):
        h.claim(list(range(100, 100 + 2 * BULK)), [], 2 * BULK)
    with pytest.raises(ValueError, match="out of range"):
        h.claim(list(range(990, 990 + BULK)), [], BULK)
    assert h.as_set() == {150}
