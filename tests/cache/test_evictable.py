"""EvictableHeap: lazy deletion, keys re-asked only for touched tops, re-keying on key_epoch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixkv.cache.evictable import EvictableHeap
from prefixkv.cache.policies import EvictionPolicy


@dataclass(eq=False)
class Item:
    """An entry as the heap sees it, with a policy-visible value."""

    value: float
    tick: int = 0
    heap_ver: int = 0
    in_heap: bool = False


class CountingPolicy(EvictionPolicy):
    """Key = the item's value (+ a shift); counts key calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.shift: dict[int, float] = {}

    def key(self, entry: Any) -> Any:
        self.calls += 1
        return entry.value + self.shift.get(id(entry), 0.0)


def test_pop_after_peek_asks_no_key_for_an_untouched_top() -> None:
    pol = CountingPolicy()
    heap = EvictableHeap(pol)
    items = [Item(float(v)) for v in (5, 3, 9, 1)]
    for it in items:
        heap.push(it)
    assert pol.calls == 4
    assert heap.peek_key() == 1.0 and heap.peek_key() == 1.0
    assert heap.pop() is items[3]
    assert [heap.pop().value for _ in range(3)] == [3.0, 5.0, 9.0]
    assert pol.calls == 4 and heap.pop() is None and len(heap) == 0


def test_a_touched_top_is_rekeyed_and_moves() -> None:
    """A monotone-key index does not re-push touched entries: the heap re-keys the top when
    its tick moved since it was keyed, and files it again by its new key."""
    pol = CountingPolicy()
    heap = EvictableHeap(pol)
    a, b = Item(1.0), Item(2.0)
    heap.push(a)
    heap.push(b)
    a.value, a.tick = 3.0, 7  # touched: its key grew
    assert heap.peek_key() == 2.0 and pol.calls == 3
    assert heap.pop() is b and heap.pop() is a and pol.calls == 3
    c = Item(1.0)
    heap.push(c)
    c.tick = 8  # touched, key unchanged: keeps its place, re-asked once only
    assert heap.peek_key() == 1.0 and heap.peek_key() == 1.0 and pol.calls == 5


def test_key_epoch_rekeys_every_live_entry() -> None:
    pol = CountingPolicy()
    heap = EvictableHeap(pol)
    items = [Item(float(v)) for v in range(5)]
    for it in items:
        heap.push(it)
    heap.discard(items[2])
    pol.shift = {id(items[0]): 10.0, id(items[4]): -10.0}  # keys moved without a touch
    assert heap.peek_key() == 0.0  # no epoch bump: stored keys stand
    pol.key_epoch += 1
    assert heap.peek_key() == -6.0 and pol.calls == 5 + 4
    assert [heap.pop() for _ in range(4)] == [items[4], items[1], items[3], items[0]]
    assert heap.pop() is None


class DepthOnlyPolicy(CountingPolicy):
    """Declares both: a re-file of an entry already in the heap keeps its item."""

    monotone_keys = True
    depth_monotone_keys = True


def test_refiling_a_filed_entry_leaves_no_stale_item_under_depth_only_keys() -> None:
    """An index re-files the lower part of a split; under a policy whose key reads the blocks
    only through ``depth`` (unchanged by a split) the item stays, so pops meet no stale item."""
    for policy, items_after in ((DepthOnlyPolicy(), 2), (CountingPolicy(), 3)):
        heap = EvictableHeap(policy)
        a, b = Item(1.0), Item(2.0)
        heap.push(a)
        heap.push(b)
        heap.push(a)  # a split of a: same key
        assert len(heap._heap) == items_after and len(heap) == 2
        assert heap.pop_and_peek() == (a, 2.0)
        assert heap.pop_and_peek() == (b, None) and heap.pop_and_peek() == (None, None)


class ShapedPolicy(EvictionPolicy):
    """Key = ``shape(value)``: tuples of one length (flat items) until ``shape`` changes."""

    def __init__(self) -> None:
        self.shape = lambda v: (v, -1)

    def key(self, entry: Any) -> Any:
        return self.shape(entry.value)


def test_flat_items_order_like_keys_and_nest_when_a_key_changes_shape() -> None:
    """Tuple keys of one length are stored flat (one tuple an item); a key of another shape
    (a longer tuple, then a float-led mix) nests every item, mid-run and inside a re-key, and
    the pops still follow the keys' own order."""
    pol = ShapedPolicy()
    heap = EvictableHeap(pol)
    items = [Item(float(v)) for v in (5, 3, 9, 1, 7)]
    for it in items:
        heap.push(it)
    assert heap._flat == 2 and all(len(it) == 6 and it[0] == it[-1].value for it in heap._heap)
    assert heap.peek_key() == (1.0, -1)
    assert heap.pop() is items[3]
    pol.shape = lambda v: (v, -1, 0)  # a longer tuple: a shorter one would sort first
    heap.push(Item(3.0))
    assert heap._flat == 0 and all(len(it) == 6 and type(it[1]) is tuple for it in heap._heap)
    assert [heap.pop().value for _ in range(2)] == [3.0, 3.0]
    rest = [Item(4.0), Item(8.0)]
    heap.push(rest[0])
    heap.push(rest[1])
    assert [heap.pop().value for _ in range(4)] == [4.0, 5.0, 7.0, 8.0]
    heap2 = EvictableHeap(pol2 := ShapedPolicy())
    more = [Item(float(v)) for v in (2, 6, 4)]
    for it in more:
        heap2.push(it)
    pol2.shape = lambda v: (v, -1) if v < 5 else (v,)  # a re-key meets two shapes
    pol2.key_epoch += 1
    assert heap2.peek_key() == (2.0, -1) and heap2._flat == 0
    more[0].value, more[0].tick = 9.0, 1  # touched: re-keyed at the top, filed by its new key
    assert [heap2.pop() for _ in range(3)] == [more[2], more[1], more[0]]
