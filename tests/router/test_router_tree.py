"""One worker's approximate prefix tree: matching, bounds, lazy ids (real prefixkv.cache)."""

from __future__ import annotations

import pytest

from prefixkv.router.keys import completion_key
from prefixkv.router.tree import ApproxTree, LazyIds


def key(text: str):
    return completion_key({"prompt": text}, 8)


def test_tree_matches_inserted_prefixes_in_chunks() -> None:
    tree = ApproxTree(1000)
    a = key("shared prefix / question one")  # 28 bytes: chunks of 8, 8, 8, 4
    b = key("shared prefix / another one")
    assert tree.match(a) == 0
    tree.insert(a)
    assert tree.match(a) == len(a) == 4
    assert tree.match(b) == 2  # "shared prefix / " is two full chunks
    tree.insert(b)
    assert tree.size == len(a) + len(b) - 2
    tree.reset()
    assert tree.size == 0 and tree.match(a) == 0


def test_tree_grows_to_twice_its_bound_then_trims_lru_first() -> None:
    now = [0.0]
    tree = ApproxTree(10, clock=lambda: now[0])
    keys = [key(c * 40) for c in "abcdef"]  # 5 chunks each
    for k in keys:
        now[0] += 1
        tree.insert(k)
    assert tree.size == 20  # the hard ceiling: 2 * max_size
    assert tree.match(keys[0]) == 0 and tree.match(keys[-1]) == 5  # oldest went first
    now[0] += 1
    tree.match(keys[2])  # a match refreshes recency
    assert tree.trim() == 10 and tree.size == 10
    assert tree.match(keys[2]) == 5 and tree.match(keys[-1]) == 5


def test_key_longer_than_the_tree_keeps_its_head() -> None:
    tree = ApproxTree(3)
    k = key("x" * 80)  # 10 chunks
    tree.insert(k)
    assert tree.size == 6 and tree.match(k) == 6


def test_ids_are_lazy_and_reused() -> None:
    ids = LazyIds(5)
    assert ids.available == 5 and ids.take(3) == [0, 1, 2]
    ids.give([1])
    assert ids.take(2) == [1, 3] and ids.available == 1
    with pytest.raises(ValueError, match="available"):
        ids.take(2)
    ids.clear()
    assert ids.available == 5


def test_a_huge_bound_allocates_nothing_up_front() -> None:
    import tracemalloc

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    # --max-tree-size 4194304 (bytes) at 64-byte chunks, over 4 workers: 1.45 GB before lazy ids
    trees = [ApproxTree((1 << 22) // 64) for _ in range(4)]
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert used < 2 * (1 << 20)  # the index's 1-byte-per-id map, nothing per element
    assert all(t.size == 0 for t in trees)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_size"):
        ApproxTree(0)


def test_tree_eviction_policy_can_change_and_is_validated() -> None:
    tree = ApproxTree(100, eviction_policy="fifo")
    tree.insert(key("a prompt of a few chunks"))
    assert tree.eviction_policy == "fifo" and tree.size > 0
    assert not tree.set_eviction_policy("FIFO")  # same policy: the tree is kept
    assert tree.size > 0
    assert tree.set_eviction_policy("ghost")
    assert tree.eviction_policy == "ghost" and tree.size == 0  # rebuilt empty
    tree.insert(key("a prompt of a few chunks"))
    assert tree.match(key("a prompt of a few chunks")) == tree.size
    with pytest.raises(ValueError, match="eviction_policy"):
        tree.set_eviction_policy("mru")
    assert tree.eviction_policy == "ghost" and tree.size > 0  # a bad name changes nothing
    with pytest.raises(ValueError, match="eviction_policy"):
        ApproxTree(100, eviction_policy="mru")


def test_insert_with_trim_keeps_the_key_just_routed() -> None:
    now = [0.0]
    tree = ApproxTree(6, eviction_policy="lfu", clock=lambda: now[0])
    old = key("old prompt, used twice")  # 3 chunks of 8 bytes
    tree.insert(old, trim=True)
    now[0] += 1
    tree.match(old)
    now[0] += 1
    new = key("a new prompt that is longer: 5 chunks")
    tree.insert(new, trim=True)
    # LFU would evict the new leaf first (fewest uses); it is running on the worker, so the
    # old prompt pays instead, and the tree is at its bound
    assert tree.match(new) == len(new) and tree.size == 6
    assert tree.match(old) < len(old)
    huge = key("x" * 80)  # 10 chunks: more than the bound, kept whole while it runs
    tree.insert(huge, trim=True)
    assert tree.match(huge) == 10 and tree.size == 10
    tree.trim()  # once it is no longer protected, the bound applies again
    assert tree.size == 6
