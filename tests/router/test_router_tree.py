"""Approximate per-worker prefix trees: keys, matching, bounds (real prefixkv.cache)."""

from __future__ import annotations

import pytest

from prefixkv.router.tree import ApproxTree, PrefixTrees, chat_key, completion_key


def chat(*contents: str, model: str = "m") -> dict:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return {"model": model, "messages": [{"role": r, "content": c} for r, c in zip(roles, contents)]}


def test_chat_key_of_next_turn_extends_previous_turn() -> None:
    k1 = chat_key(chat("sys", "hello"))
    k2 = chat_key(chat("sys", "hello", "hi!", "how are you"))
    assert len(k2) > len(k1)
    assert k2.ids[: len(k1)] == k1.ids
    assert k1.namespace == k2.namespace


def test_content_parts_render_like_plain_text() -> None:
    parts = {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}
    ]}
    assert chat_key(parts) == chat_key({"model": "m", "messages": [{"role": "user", "content": "abc"}]})


def test_completion_keys() -> None:
    text = completion_key({"model": "m", "prompt": "héllo"})
    assert text.ids == tuple("héllo".encode())
    assert completion_key({"model": "m", "prompt": ["héllo", "x"]}) == text
    ids = completion_key({"model": "m", "prompt": [5, 6, 700]})
    assert ids.ids == (5, 6, 700) and ids.namespace != text.namespace
    assert completion_key({"model": "m", "prompt": 3}).ids == ()
    # model and cache_salt separate namespaces: a worker never shares entries across them
    assert completion_key({"model": "n", "prompt": "héllo"}).namespace != text.namespace
    salted = completion_key({"model": "m", "prompt": "héllo", "cache_salt": "t1"})
    assert salted.namespace != text.namespace


def test_tree_matches_inserted_prefixes() -> None:
    tree = ApproxTree(1000)
    a = completion_key({"prompt": "shared prefix / question one"})
    b = completion_key({"prompt": "shared prefix / another one"})
    assert tree.match(a) == 0
    tree.insert(a)
    assert tree.match(a) == len(a)
    assert tree.match(b) == len("shared prefix / ")
    tree.insert(b)
    assert tree.size == len(a) + len(b) - len("shared prefix / ")
    tree.reset()
    assert tree.size == 0 and tree.match(a) == 0


def test_tree_grows_to_twice_its_bound_then_trims_lru_first() -> None:
    now = [0.0]
    tree = ApproxTree(100, clock=lambda: now[0])
    keys = [completion_key({"prompt": c * 40}) for c in "abcdef"]
    for k in keys:
        now[0] += 1
        tree.insert(k)
    assert tree.size == 200  # the pool's hard ceiling: 2 * max_size
    assert tree.match(keys[0]) == 0 and tree.match(keys[-1]) == 40  # oldest went first
    now[0] += 1
    tree.match(keys[2])  # a match refreshes recency
    assert tree.trim() == 100 and tree.size == 100
    assert tree.match(keys[2]) == 40 and tree.match(keys[-1]) == 40


def test_key_longer_than_the_pool_keeps_its_head() -> None:
    tree = ApproxTree(10)
    key = completion_key({"prompt": "x" * 50})
    tree.insert(key)
    assert tree.size == 20 and tree.match(key) == 20


def test_eviction_interval_zero_trims_after_each_insert() -> None:
    trees = PrefixTrees(["w"], max_size=30, eviction_interval=0)
    trees.insert("w", completion_key({"prompt": "y" * 50}))
    assert trees.size("w") == 30
    lazy = PrefixTrees(["w"], max_size=30, eviction_interval=60)
    lazy.insert("w", completion_key({"prompt": "y" * 50}))
    assert lazy.sizes() == {"w": 50}
    assert lazy.trim() == 20 and lazy.size("w") == 30


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_size"):
        ApproxTree(0)
    with pytest.raises(ValueError, match="eviction_interval"):
        PrefixTrees(["w"], max_size=10, eviction_interval=-1)


def test_set_max_size_bounds_one_tree_and_is_capped() -> None:
    trees = PrefixTrees(["a", "b"], max_size=100, eviction_interval=0)
    for url in ("a", "b"):
        trees.insert(url, completion_key({"prompt": "z" * 80}))
    trees.set_max_size("a", 30)
    assert trees.sizes() == {"a": 30, "b": 80}
    trees.set_max_size("b", 10**9)
    assert trees.max_sizes() == {"a": 30, "b": 100}
