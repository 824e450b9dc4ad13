"""Block hashes: chained, namespaced, stable across processes, verified on hit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefixkv.cache import HashPrefixCache, hash_block_chain
from prefixkv.cache.hashing import make_block_hasher


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_hashes_agree_across_processes(algo):
    code = (
        "from prefixkv.cache import hash_block_chain;"
        f"print([h.hex() for h in hash_block_chain(list(range(40)), 16, algo={algo!r}, namespace='t')])"
    )
    out = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout
           for seed in (1, 2)]
    assert out[0] == out[1]
    local = [h.hex() for h in hash_block_chain(list(range(40)), 16, algo=algo, namespace="t")]
    assert out[0].strip() == str(local)


@pytest.mark.parametrize("namespace", [None, "t"])
def test_builtin_hashes_repeat_under_a_fixed_hash_seed(namespace):
    """``builtin`` is Python's ``hash``: per process, like vLLM's, but the same in every process
    run with the same ``PYTHONHASHSEED`` (no ``None`` hashed by address inside)."""
    code = (
        "from prefixkv.cache import hash_block_chain;"
        f"print(hash_block_chain(list(range(40)), 16, algo='builtin', namespace={namespace!r}))"
    )
    out = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={"PYTHONHASHSEED": "0", "PATH": ""}).stdout
           for _ in range(2)]
    assert out[0] == out[1] and out[0].strip()


def test_chain_depends_on_prefix_namespace_and_extra():
    a = hash_block_chain([1] * 32, 16)
    b = hash_block_chain([2] * 16 + [1] * 16, 16)
    assert a[1] != b[1]  # same block tokens, different prefix
    assert hash_block_chain([1] * 16, 16, namespace="x") != hash_block_chain([1] * 16, 16)
    assert hash_block_chain([1] * 16, 16, extra_keys=["img1"]) != hash_block_chain(
        [1] * 16, 16, extra_keys=["img2"])


def test_unknown_algo_and_unstable_namespace_rejected():
    with pytest.raises(ValueError, match="hash_algo"):
        make_block_hasher("md5")
    with pytest.raises(ValueError, match="hash_algo"):
        HashPrefixCache(8, 4, hash_algo="md5")
    with pytest.raises(ValueError, match="namespace"):
        HashPrefixCache(8, 4).match_prefix([1, 2, 3, 4], namespace=object())


def test_extra_keys_isolate_multimodal_blocks():
    cache = HashPrefixCache(16, 4)
    toks = [7] * 8
    cache.insert_prefix(toks, [1, 2], extra_keys=["imgA", "imgA"])
    assert cache.match_prefix(toks, extra_keys=["imgA", "imgA"]).match_length == 8
    assert cache.match_prefix(toks, extra_keys=["imgB", "imgB"]).match_length == 0
    assert cache.match_prefix(toks, extra_keys=["imgA", "imgB"]).match_length == 4
    with pytest.raises(ValueError, match="extra_keys has 1 entries"):
        cache.match_prefix(toks, extra_keys=["imgA"])


def test_forced_collision_never_returns_wrong_kv(monkeypatch):
    """Even if two different blocks hash equal, a hit is verified against stored tokens."""
    cache = HashPrefixCache(16, 4, hash_algo="builtin")
    monkeypatch.setattr(cache, "_hasher", lambda parent, tokens, extra: 42)
    cache.insert_prefix([1, 2, 3, 4], [5])
    assert cache.match_prefix([9, 9, 9, 9]).match_length == 0
    node = cache.insert_prefix([9, 9, 9, 9], [6])
    assert node.returned_block_ids == [6] and list(node.kv_block_ids) == []
    assert list(cache.match_prefix([1, 2, 3, 4]).matched_kv_blocks) == [5]


def test_radix_rejects_extra_keys():
    from prefixkv.cache import RadixPrefixCache

    with pytest.raises(ValueError, match="extra_keys"):
        RadixPrefixCache(8).match_prefix([1, 2], extra_keys=["a", "b"])


def test_collision_inside_one_insert_keeps_the_index_consistent(monkeypatch):
    cache = HashPrefixCache(16, 2, hash_algo="builtin")
    monkeypatch.setattr(cache, "_hasher", lambda parent, tokens, extra: 7)
    node = cache.insert_prefix([1, 2, 3, 4, 5, 6], [0, 1, 2])
    assert list(node.kv_block_ids) == [0] and node.returned_block_ids == [1, 2]
    cache.check_invariants()
    assert list(cache.match_prefix([1, 2, 3, 4]).matched_kv_blocks) == [0]
    assert sorted(cache.evict(5)) == [0]
    cache.check_invariants()
