"""HeldIds: short (Python) and bulk (C helper or numpy) claims and releases agree, bad ids change nothing, and
owner tags release whole entries in O(1) without ever freeing another entry's ids."""

from __future__ import annotations

from array import array

import pytest

from prefixkv.cache import held_ids
from prefixkv.cache.held_ids import BULK, MAX_BLOCKS, HeldIds, new_ids


@pytest.fixture(params=["c", "numpy"], autouse=True)
def helper(request, monkeypatch):
    """Every test twice: bulk claims in the C helper (when built) and in numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(held_ids, "_keypack", None)
    elif held_ids._keypack is None:
        pytest.skip("the C helper prefixkv.cache._keypack is not built")
    return request.param


def claim(h: HeldIds, ids, cached=(), stop=None):
    """Pack (as the index does) then claim."""
    packed = h.pack(ids)
    returned, taken, _ = h.claim(packed, array("I", cached), len(packed) if stop is None else stop)
    return returned, taken


def claim_owned(h: HeldIds, ids):
    """Claim ``ids`` and return (taken, owner)."""
    _, taken, owner = h.claim(h.pack(ids), array("I"), len(ids))
    return taken, owner


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
    ("bool-inside", "ints"),
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
    elif bad == "bool-inside":  # anywhere in a list: True is not block id 1
        ids[n // 2] = True
        ids[1] = n + 10
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


@pytest.mark.parametrize("n", [3, 2 * BULK])
def test_owner_release_frees_exactly_that_claim(n):
    h = HeldIds(10 * BULK)
    a, ta = claim_owned(h, list(range(n)))
    b, tb = claim_owned(h, list(range(5 * BULK, 5 * BULK + n))[::-1])
    assert ta and tb and ta != tb and h.count == 2 * n
    h.release_owner(ta, a)
    assert h.count == n and h.as_set() == set(b)
    again, tc = claim_owned(h, list(range(n)))  # the released ids can be claimed again
    assert tc != tb and h.as_set() == set(b) | set(again)


@pytest.mark.parametrize("n", [6, 2 * BULK])
@pytest.mark.parametrize("first", ["upper", "lower"])
def test_a_shared_tag_frees_each_part_only(n, first):
    """A split: two entries hold parts of one claim; releasing one part whole leaves the other
    held (its ids cleared one by one), and the last part goes in O(1)."""
    h = HeldIds(10 * BULK)
    ids, owner = claim_owned(h, list(range(n)))
    upper, lower = ids[: n // 3], ids[n // 3 :]
    assert h.share(owner, upper) == owner and h.holders(owner) == 2
    gone, kept = (upper, lower) if first == "upper" else (lower, upper)
    h.release_owner(owner, gone)
    assert h.as_set() == set(kept) and h.count == len(kept) and h.holders(owner) == 1
    with pytest.raises(ValueError, match="already cached"):
        claim(h, [kept[0]])
    h.release_owner(owner, kept)
    assert h.as_set() == set() and h.count == 0 and h.holders(owner) == 0


def test_a_tag_shared_255_times_gives_the_next_part_its_own():
    h = HeldIds(1000)
    ids, owner = claim_owned(h, list(range(300)))
    parts = [ids[i : i + 1] for i in range(256)]
    tags = [h.share(owner, p) for p in parts[:255]]
    assert set(tags[:254]) == {owner} and h.holders(owner) == 255
    assert tags[254] != owner and h.owner_of(parts[254][0]) == tags[254]


def test_dead_tags_are_swept_before_reuse():
    """Thousands of claims and whole releases: tags are recycled (the tag space stays bounded)
    and a recycled tag never resurrects ids that carried it before."""
    h = HeldIds(64)
    keep, keep_owner = claim_owned(h, [63])
    for i in range(5000):
        ids, owner = claim_owned(h, [i % 60, 60 + i % 2])
        h.release_owner(owner, ids)
        assert h.as_set() == {63} and keep_owner != owner
        if i % 7 == 0:  # and some claims released id by id (their tags have no ids left)
            ids, _ = claim_owned(h, [i % 50])
            h.release(ids)
    assert h.memory_bytes() <= 4 * 64 + 4096 and h.as_set() == {63} and h.count == 1
    h.release_owner(keep_owner, keep)
    assert h.as_set() == set()


def test_the_tag_space_grows_when_most_tags_are_alive():
    h = HeldIds(4000)
    owned = [claim_owned(h, [i]) for i in range(1500)]  # 1,500 entries alive: > 1,024 tags
    assert len({o for _, o in owned}) == 1500 and h.as_set() == set(range(1500))
    assert h.memory_bytes() >= 4 * 1500 + 1500
    for ids, o in owned[::2]:
        h.release_owner(o, ids)
    assert h.as_set() == set(range(1, 1500, 2)) and h.count == 750


def test_tags_cover_only_the_ids_used():
    """A huge id space costs nothing until its ids are claimed (a router's tree); a high id
    makes the tags cover it, lower ones stay unheld."""
    assert HeldIds(10**8).memory_bytes() < 10_000
    top = 2 * 10**6
    h = HeldIds(top)
    ids, owner = claim_owned(h, [top - BULK + i for i in range(BULK)] + [5])
    assert 5 in h and top - 1 in h and 6 not in h and top not in h and h.owner_of(10**6) == 0
    assert h.owner_of(5) == owner and h.memory_bytes() >= 4 * top
    with pytest.raises(ValueError, match="out of range"):
        claim(h, [top])
    h.release_owner(owner, ids)
    assert h.as_set() == set()


def test_a_claim_that_grows_the_tag_space_still_catches_repeats():
    h = HeldIds(10**5)
    for i in range(1023):  # every tag of the first 1,024 alive (tag 0 is "none")
        claim_owned(h, [i])
    with pytest.raises(ValueError, match="repeated"):
        claim(h, [7000, 7000])  # its tag comes from a sweep that grows the tag space
    assert 7000 not in h and h.count == 1023
    claim(h, [7000, 7001])
    assert {7000, 7001} <= h.as_set()


def test_tags_grow_while_a_failed_claim_is_still_held():
    """A caller that keeps a claim's ``ValueError`` (its traceback holds numpy views of the
    tags) can still claim ids that make the tags grow."""
    h = HeldIds(10**6)
    claim(h, list(range(BULK)))
    with pytest.raises(ValueError, match="already cached") as kept:
        claim(h, list(range(BULK - 1, 2 * BULK - 1)))
    _, taken = claim(h, list(range(500_000, 500_000 + BULK)))
    assert kept.value is not None and 500_000 in h and h.count == 2 * BULK
    assert h.as_set() == set(range(BULK)) | set(taken)
