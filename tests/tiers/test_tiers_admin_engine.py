"""Pins and admin resets across the tiers, through a real engine (demo model) and a real
``valkey-server``: a pinned prefix is never dropped from the host or disk tier while other
prompts churn them; ``reset_prefix_cache(tiers=...)`` clears exactly the tiers it names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefixkv.engine import SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
BS = 16


def keys_of(llm: Any, prompt: list[int]) -> list[bytes]:
    tiers = llm.engine.kv.tiers
    return tiers.keyer.extend([], prompt, len(prompt) // BS, None)  # type: ignore[no-any-return]


def churn(llm: Any, tokens: Any, seed: int, n: int = 6) -> None:
    """Unrelated prompts, each spilled out of the pool: the host and disk tiers fill and evict."""
    for i in range(n):
        llm.generate([tokens(seed + i, 3 * BS + 1)], ONE)
        llm.engine.kv.spill()
    assert llm.engine.kv.tiers.flush()


def test_pinned_prefix_stays_on_host_and_disk(make_llm: Any, tokens: Any, tmp_path: Path) -> None:
    llm = make_llm(block_size=BS, kv_offload_size=4, kv_disk_dir=tmp_path, kv_disk_size=6)
    kv = llm.engine.kv
    system = tokens(1, 3 * BS)
    llm.generate([system + [33]], ONE)
    kv.spill()  # the prefix's 3 blocks: host and disk
    keys = keys_of(llm, system)
    assert all(k in kv.tiers.host for k in keys)
    llm.pin_prefix(system, description="sys")  # loaded back from the host tier, then pinned
    churn(llm, tokens, 100)
    host, disk = kv.tiers.host, kv.tiers.disk
    assert host.counters.get("evictions") > 0 and disk.counters.get("evictions") > 0
    assert all(k in host for k in keys) and set(keys) <= set(disk.stored_keys())
    assert kv.cache.match_prefix(system).match_length == 3 * BS  # and the pool keeps it
    assert llm.unpin_prefix(system)
    assert len(kv.tiers.pinned) == 0
    kv.spill()
    churn(llm, tokens, 200)
    assert not any(k in host for k in keys) and not set(keys) & set(disk.stored_keys())
    llm.engine.close()


def test_two_pins_share_blocks(make_llm: Any, tokens: Any, tmp_path: Path) -> None:
    llm = make_llm(block_size=BS, kv_offload_size=4, kv_disk_dir=tmp_path, kv_disk_size=6)
    kv = llm.engine.kv
    long = tokens(2, 4 * BS)
    llm.pin_prefix(long)
    llm.pin_prefix(long[: 2 * BS])  # shares the first two blocks
    keys = keys_of(llm, long)
    assert kv.tiers.pinned.snapshot() == frozenset(keys)
    assert llm.unpin_prefix(long)
    assert kv.tiers.pinned.snapshot() == frozenset(keys[:2])
    churn(llm, tokens, 300)
    assert set(keys[:2]) <= set(kv.tiers.disk.stored_keys())
    llm.reset_prefix_cache()  # unpins everything, in every tier
    assert len(kv.tiers.pinned) == 0 and llm.list_pinned() == []
    llm.engine.close()


def test_pinned_prefix_on_the_remote_server(
    make_llm: Any, tokens: Any, small_valkey: Any
) -> None:
    """A pin reaches the shared tier: its blocks lose their expiry (the server's volatile-lru
    cannot evict them), a second worker reuses them after the first worker's other blocks were
    evicted, and unpinning (or a reset) gives the expiry back."""
    import redis

    from prefixkv.tiers.remote import PIN_PREFIX, PREFIX

    client = redis.Redis.from_url(small_valkey.url)
    a = make_llm(block_size=BS, kv_remote=small_valkey.url, kv_remote_ttl=600)
    system = tokens(3, 4 * BS)
    a.pin_prefix(system)
    keys = keys_of(a, system)
    assert a.engine.kv.tiers.flush()
    assert [client.ttl(PREFIX + k) for k in keys] == [-1] * 4
    assert [client.get(PIN_PREFIX + k) for k in keys] == [b"1"] * 4
    b = make_llm(block_size=BS, kv_remote=small_valkey.url, kv_remote_ttl=600, num_kv_blocks=64)
    for i in range(40):  # far more KV than the 8 MB server holds
        b.generate([tokens(500 + i, 16 * BS + 1)], ONE)
        b.engine.kv.spill()
    assert b.engine.kv.tiers.flush() and client.dbsize() < 40 * 16
    c = make_llm(block_size=BS, kv_remote=small_valkey.url)
    assert cached(c, system + [40]) == 4 * BS  # all four from the shared tier
    assert a.unpin_prefix(system)
    assert a.engine.kv.tiers.flush()
    assert all(0 < client.ttl(PREFIX + k) <= 600 for k in keys) and not client.keys(PIN_PREFIX + b"*")
    a.pin_prefix(system)
    a.reset_prefix_cache()  # unpins everything, the remote pins included
    assert a.engine.kv.tiers.flush() and not client.keys(PIN_PREFIX + b"*")


def cached(llm: Any, prompt: list[int]) -> int:
    return llm.generate([prompt], ONE)[0].num_cached_tokens  # type: ignore[no-any-return]


@pytest.mark.parametrize("tiers,left", [
    ("local", {"disk", "remote"}), ("none", {"host", "disk", "remote"}), ("all", set()),
    ("host,disk", {"remote"}), (["remote"], {"host", "disk"}),
])
def test_reset_clears_the_named_tiers(
    tiers: Any, left: set[str], make_llm: Any, tokens: Any, tmp_path: Path, valkey: Any
) -> None:
    llm = make_llm(block_size=BS, kv_offload_size=64, kv_disk_dir=tmp_path, kv_remote=valkey.url)
    kv = llm.engine.kv
    prompt = tokens(3, 4 * BS + 1)
    llm.generate([prompt], ONE)
    kv.spill()
    assert kv.tiers.flush()
    out = llm.engine.reset_prefix_cache_tiers(tiers)
    assert out["pool"] == 0 and kv.cache.num_cached_blocks == 0  # spilled already
    cleared = {t for t in ("host", "disk", "remote") if out.get(t)}
    assert cleared == {"host", "disk", "remote"} - left
    assert (len(kv.tiers.host) > 0) == ("host" in left)
    assert (len(kv.tiers.disk) > 0) == ("disk" in left)
    hits = cached(llm, prompt[:-1] + [34])
    assert hits == (4 * BS if left else 0)  # any tier left answers the whole prefix
    stats = {t.tier: t.hits for t in llm.get_stats().tiers}
    top = next((t for t in ("host", "disk", "remote") if t in left), None)
    assert (top is None and sum(stats.values()) == 0) or stats[top] == 4
    llm.engine.close()


def test_reset_bad_tiers_and_no_caching(make_llm: Any) -> None:
    llm = make_llm(kv_offload_size=8)
    with pytest.raises(ValueError, match="tiers"):
        llm.reset_prefix_cache("everything")
    with pytest.raises(ValueError, match="tiers"):
        llm.reset_prefix_cache(["host", "gpu"])
    off = make_llm(enable_prefix_caching=False)
    assert off.reset_prefix_cache("all") is False
    assert off.engine.reset_prefix_cache_tiers("all") is None


def test_a_small_disk_tier_keeps_a_prompts_head(make_llm: Any, tokens: Any, tmp_path: Path) -> None:
    """Disk smaller than two prompts: the first prompt loses its tail, not its head, so a
    restarted engine still serves its leading blocks from disk (an LRU by write order would
    have dropped its first block and left nothing reachable)."""
    a, b = tokens(7, 6 * BS), tokens(8, 6 * BS)
    llm = make_llm(block_size=BS, kv_disk_dir=tmp_path, kv_disk_size=8)
    llm.generate([a + [33]], ONE)
    llm.generate([b + [33]], ONE)
    assert llm.engine.kv.tiers.flush()
    llm.engine.close()
    again = make_llm(block_size=BS, kv_disk_dir=tmp_path, kv_disk_size=8)
    assert cached(again, a + [34]) == 2 * BS  # a's two head blocks, from disk
    assert again.engine.kv.tiers.flush()  # a's recomputed tail is written: b's tail makes room
    assert cached(again, b + [34]) == 2 * BS
