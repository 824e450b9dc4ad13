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
