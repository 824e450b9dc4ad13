"""Per-tenant quotas in the lower tiers (issue 43, item 3): a tenant flooding the host, disk or
Valkey tier far past its quota loses its own blocks there, never another tenant's; the disk
counts tenants again after a restart (records without a tenant are the default tenant's);
Valkey counts on the server and drops expired members; and through a real engine the outputs
are unchanged while the stats show blocks per tenant and tier."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest

from prefixkv.engine import SamplingParams
from prefixkv.server.cache_metrics import CacheView, cache_metrics, label
from prefixkv.tiers.codec import decode, encode, header_size, is_record_of, record_tenant
from prefixkv.tiers.disk import DiskTier
from prefixkv.tiers.host import HostTier
from prefixkv.tiers.quotas import DEFAULT_TENANT, TenantKeys, tenant_label
from prefixkv.tiers.remote import COUNTS_EVERY, PREFIX, RemoteTier
from prefixkv.tiers.remote_quota import TENANT_PREFIX
from prefixkv.tiers.retained import RetainedKeys
from prefixkv.tiers.spec import TierSpec

LAYOUT = "uint8:16"
A, B = tenant_label(("tenant-a", None)), tenant_label(("tenant-b", None))


def key(tenant: str, i: int) -> bytes:
    return hashlib.sha256(f"{tenant}/{i}".encode()).digest()


def payload(i: int) -> bytes:
    return bytes([i % 256]) * 16


# ------------------------------------------------------------------ the counting itself


def test_labels_are_the_metrics_labels_and_hide_the_salt() -> None:
    for ns in (None, "s", ("salt", None), ("salt", "lora-1"), (None, 3)):
        assert tenant_label(ns) == label(ns)
    assert tenant_label(None) == DEFAULT_TENANT == "default"
    assert "tenant-a" not in A and len(A) == 12 and A != B


def test_victims_take_an_over_quota_tenants_excess_first() -> None:
    t = TenantKeys(quota=2)
    order = [key(B, 0), key(B, 1), key(A, 0), key(A, 1), key(A, 2), key(A, 3)]  # LRU first
    for k in order:
        t.add(k, B if k in order[:2] else A)
    retained = RetainedKeys()
    assert t.over() == [(A, 2)]
    # plain LRU would take B's two blocks; A is 2 over, so its own oldest go
    assert t.victims(2, lambda k: True, retained, order) == [key(A, 0), key(A, 1)]
    # a third victim comes from the tier's order once A's excess is taken
    assert t.victims(3, lambda k: True, retained, order) == [key(A, 0), key(A, 1), key(B, 0)]
    # A's retained blocks go after its unretained ones; unevictable ones are skipped
    retained.add([key(A, 0)], priority=50, ttl_s=60)
    assert t.victims(2, lambda k: k != key(A, 2), retained, order) == [key(A, 1), key(A, 3)]
    t.touch(key(A, 1))  # now A's most recent
    assert t.victims(1, lambda k: True, retained, order) == [key(A, 2)]
    t.remove([key(A, 0), key(A, 1)])
    assert t.counts() == {B: 2, A: 2} and t.over() == []
    assert TenantKeys(None).over() == []
    with pytest.raises(ValueError, match="kv_blocks_per_tenant"):
        TenantKeys(-1)


def test_counts_and_over_quota_tenants_agree_with_a_recount() -> None:
    """Random adds, touches and removes: the counts, the over-quota list and each tenant's
    order match a plain recount of one LRU list."""
    import random

    rng = random.Random(7)
    t, model = TenantKeys(quota=3), []  # model: (key, tenant), least recent first
    for _ in range(3000):
        k, tenant = key("r", rng.randrange(40)), rng.choice("abc")
        op = rng.random()
        held = [m for m in model if m[0] == k]
        if op < 0.5 and not held:
            t.add(k, tenant)
            model.append((k, tenant))
        elif op < 0.75 and held:
            t.touch(k)
            model.remove(held[0])
            model.append(held[0])
        elif held:
            t.remove([k])
            model.remove(held[0])
        recount = {x: sum(1 for _, y in model if y == x) for x in "abc"}
        assert t.counts() == {x: n for x, n in recount.items() if n}
        assert sorted(t.over()) == sorted((x, n - 3) for x, n in recount.items() if n > 3)
    want = [k for tenant, excess in t.over() for k in [k for k, y in model if y == tenant][:excess]]
    order = [k for k, _ in model]
    assert want and t.victims(len(want), lambda k: True, RetainedKeys(), order) == want


def test_tier_quotas_default_to_the_pools_and_can_be_set_per_tier() -> None:
    assert TierSpec().tenant_quotas(None) == {"host": None, "disk": None, "remote": None}
    assert TierSpec().tenant_quotas(64) == {"host": 64, "disk": 64, "remote": 64}
    assert TierSpec(blocks_per_tenant="128").tenant_quotas(64) == dict.fromkeys(
        ("host", "disk", "remote"), 128)
    got = TierSpec(blocks_per_tenant="disk=500, remote=9000").tenant_quotas(64)
    assert got == {"host": 64, "disk": 500, "remote": 9000}
    for bad in ("-1", "gpu=3", "host=", "host=1.5", -2, 1.5, "lots"):
        with pytest.raises(ValueError, match="kv_blocks_per_tenant"):
            TierSpec(blocks_per_tenant=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ host and disk


def test_host_tier_flooded_by_one_tenant_keeps_the_others_blocks() -> None:
    host = HostTier(16, tenant_quota=8)
    for i in range(6):
        assert host.reserve(key(B, i), B) is not None
    for i in range(200):  # A floods far past its quota
        assert host.reserve(key(A, i), A) is not None
    assert all(key(B, i) in host for i in range(6))
    assert host.tenants.counts() == {B: 6, A: 10}  # A over quota only by the room B leaves free
    assert host.counters.get("evictions") == 200 + 6 - 16
    # B's own LRU still runs as usual, and a held A block is never taken
    slot = host.hold(key(A, 199))
    assert slot is not None
    assert host.clear() == 15 and host.tenants.counts() == {A: 1}


def test_an_over_quota_tenant_loses_its_least_recently_used_blocks(tmp_path: Path) -> None:
    """Within a tenant the tier's own recency holds: a block read or touched again is kept
    over its tenant's older ones (host: hold / touch / a repeated reserve; disk: touch / read)."""
    host = HostTier(7, tenant_quota=2)
    for i in range(5):
        host.reserve(key(A, i), A)
    for i in range(2):
        host.reserve(key(B, i), B)
    host.touch([key(A, 0)])
    assert host.hold(key(A, 1)) is not None
    host.release(key(A, 1))
    assert host.reserve(key(A, 2), A) is None  # stored already: refreshed
    host.reserve(key(A, 5), A)
    host.reserve(key(A, 6), A)
    assert [i for i in range(7) if key(A, i) in host] == [0, 1, 2, 5, 6]
    d = DiskTier(tmp_path, 7, LAYOUT, 16, tenant_quota=2)
    for i in range(5):
        d.submit(key(A, i), payload(i), A)
    for i in range(2):
        d.submit(key(B, i), payload(i), B)
    assert d.flush()
    d.touch([key(A, 0)])
    assert d.read(key(A, 1)) == payload(1)
    d.submit(key(A, 5), payload(5), A)
    d.submit(key(A, 6), payload(6), A)
    assert d.flush()
    assert [i for i in range(7) if d.contains(key(A, i))] == [0, 1, 4, 5, 6]
    d.close()


def test_without_a_quota_the_flood_flushes_the_other_tenant() -> None:
    """The control: the same flood with no quota (the tiers before quotas) evicts B's blocks."""
    host = HostTier(16)
    for i in range(6):
        host.reserve(key(B, i), B)
    for i in range(200):
        host.reserve(key(A, i), A)
    assert not any(key(B, i) in host for i in range(6))


def test_disk_tier_flooded_by_one_tenant_keeps_the_others_files_across_a_restart(
        tmp_path: Path) -> None:
    d = DiskTier(tmp_path, 16, LAYOUT, 16, tenant_quota=8)
    for i in range(6):
        d.submit(key(B, i), payload(i), B)
    assert d.flush()
    for i in range(100):
        d.submit(key(A, i), payload(i), A)
    assert d.flush()
    assert set(d.stored_keys()) >= {key(B, i) for i in range(6)}
    assert d.tenant_counts() == {B: 6, A: 10} and len(list(tmp_path.glob("*.kvb"))) == 16
    d.close()
    again = DiskTier(tmp_path, 16, LAYOUT, 16, tenant_quota=8)  # a warm restart
    assert again.tenant_counts() == {B: 6, A: 10}  # read back from the records' headers
    for i in range(100, 200):  # A floods again: still only its own files go
        again.submit(key(A, i), payload(i), A)
    assert again.flush()
    assert all(again.read(key(B, i)) == payload(i) for i in range(6))
    assert again.tenant_counts() == {B: 6, A: 10}
    again.close()


def test_disk_records_without_a_tenant_are_the_default_tenants(tmp_path: Path) -> None:
    """Files written before tenants were kept (no label in the header) count as ``default``;
    a default-tenant record is byte for byte what those versions wrote."""
    old = encode(key("old", 0), LAYOUT, payload(0))
    assert encode(key("old", 0), LAYOUT, payload(0), tenant="") == old
    (tmp_path / (key("old", 0).hex() + ".kvb")).write_bytes(old)
    d = DiskTier(tmp_path, 4, LAYOUT, 16, tenant_quota=1)
    assert d.tenant_counts() == {DEFAULT_TENANT: 1}
    d.submit(key(A, 0), payload(1), A)
    d.submit(key("default", 1), payload(2))
    assert d.flush()
    assert d.tenant_counts() == {DEFAULT_TENANT: 2, A: 1}
    assert d.read(key("old", 0)) == payload(0) and d.read(key(A, 0)) == payload(1)
    d.close()


def test_codec_tenant_label_in_the_header() -> None:
    rec = encode(key(A, 0), LAYOUT, payload(3), b"s3cret", tenant=A)
    assert decode(rec, key(A, 0), LAYOUT, 16, b"s3cret") == payload(3)
    head = rec[: header_size(LAYOUT) + 32]
    assert is_record_of(head, key(A, 0), LAYOUT, authenticated=True)
    assert is_record_of(rec[: header_size(LAYOUT)], key(A, 0), LAYOUT, authenticated=True)
    assert record_tenant(head, LAYOUT) == A
    assert record_tenant(encode(key(A, 0), LAYOUT, payload(3)), LAYOUT) == ""
    with pytest.raises(ValueError, match="tenant label"):
        encode(key(A, 0), LAYOUT, payload(3), tenant="x" * 33)


# ------------------------------------------------------------------ Valkey


def test_remote_tier_flooded_by_one_tenant_keeps_the_others_blocks(valkey: Any) -> None:
    import redis

    client = redis.Redis.from_url(valkey.url)
    r = RemoteTier(valkey.url, LAYOUT, 16, timeout=5.0, ttl=3600, tenant_quota=8)
    other = RemoteTier(valkey.url, LAYOUT, 16, timeout=5.0, ttl=3600, tenant_quota=8)  # a worker
    for i in range(6):
        r.submit(key(B, i), payload(i), B)
    r.submit(key(A, 0), payload(0), A)
    r.submit(key(A, 1), payload(1), A)
    r.pin([key(A, 0)], [payload(0)])  # a pinned block of A's is never trimmed
    assert r.flush()
    client.delete(PREFIX + key(A, 1))  # as if it had expired: its member must not count
    for i in range(2, 60):  # A floods from two workers
        (r if i % 2 else other).submit(key(A, i), payload(i), A)
    assert r.flush() and other.flush()
    assert r.read_many([key(B, i) for i in range(6)]) == [payload(i) for i in range(6)]
    assert client.exists(PREFIX + key(A, 0)) == 1  # pinned: kept (counted: A keeps 7 more)
    assert client.zcard(TENANT_PREFIX + A.encode()) == 8
    kept = [i for i in range(60) if client.exists(PREFIX + key(A, i))]
    assert kept[0] == 0 and len(kept) == 8 and min(kept[1:]) >= 20  # the oldest went
    assert r.tenant_counts() == {B: 6, A: 8}
    assert r.counters.get("evictions") + other.counters.get("evictions") == 60 - 8 - 1
    plain = RemoteTier(valkey.url, LAYOUT, 16)
    assert plain.tenant_counts() is None  # no quota: not counted
    plain.close()
    assert r.clear() is not None and r.tenant_counts() == {}
    r.close()
    other.close()


def test_remote_counts_drop_expired_blocks_under_the_quota_too(valkey: Any) -> None:
    """A tenant under its quota is never trimmed, yet its blocks that expired stop counting:
    members written more than a ttl ago are checked when the counts are read."""
    import redis

    client = redis.Redis.from_url(valkey.url)
    now = [0.0]
    r = RemoteTier(valkey.url, LAYOUT, 16, timeout=5.0, ttl=60, tenant_quota=100,
                   clock=lambda: now[0])
    for i in range(4):
        r.submit(key(A, i), payload(i), A)
    assert r.flush()
    assert r.tenant_counts() == {A: 4}
    tq = TENANT_PREFIX + A.encode()
    client.zadd(tq, {PREFIX + key(A, 0): 1, PREFIX + key(A, 1): 1})  # written long ago...
    client.delete(PREFIX + key(A, 0))  # ...and expired since; block 1 was retained
    client.delete(PREFIX + key(A, 2))  # expired, but written within the ttl: still counted
    assert r.tenant_counts() == {A: 4}  # a scrape within COUNTS_EVERY: the last reading
    now[0] += COUNTS_EVERY
    assert r.tenant_counts() == {A: 3}
    assert client.zscore(tq, PREFIX + key(A, 1)) > 1  # alive: re-scored, not checked again
    r.close()


def test_remote_tier_without_a_quota_writes_no_tenant_sets(valkey: Any) -> None:
    import redis

    client = redis.Redis.from_url(valkey.url)
    r = RemoteTier(valkey.url, LAYOUT, 16, timeout=5.0)
    for i in range(5):
        r.submit(key(A, i), payload(i), A)
    assert r.flush()
    assert sorted(client.keys()) == sorted(PREFIX + key(A, i) for i in range(5))
    r.close()


# ------------------------------------------------------------------ through the engine

ONE = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BS = 16


def test_engine_quota_in_every_local_tier_outputs_unchanged_and_visible(
        make_llm: Any, tokens: Any, tmp_path: Path) -> None:
    """Tenant B caches a few prompts; tenant A floods the pool, host and disk far past its
    quota. B's blocks stay in the host and disk tiers; the outputs are those of an engine
    without tiers; the stats and metrics show each tenant's blocks per tier."""
    llm = make_llm(block_size=BS, num_kv_blocks=32, kv_offload_size="24blocks",
                   kv_disk_dir=tmp_path, kv_disk_size="24blocks", max_cached_blocks_per_tenant=8)
    plain = make_llm(block_size=BS, num_kv_blocks=32)
    quiet = [tokens(500 + i, 3 * BS + 1) for i in range(2)]
    flood = [tokens(600 + i, 3 * BS + 1) for i in range(24)]
    got = [o.outputs[0].token_ids for o in llm.generate(quiet, ONE, cache_salt="tenant-b")]
    got += [o.outputs[0].token_ids for o in llm.generate(flood, ONE, cache_salt="tenant-a")]
    kv = llm.engine.kv
    kv.spill()
    assert kv.tiers.flush()
    want = [o.outputs[0].token_ids for o in plain.generate(quiet + flood, ONE)]
    assert got == want  # (a salt changes what is shared, never what is computed)
    b_keys = [k for p in quiet for k in kv.tiers.keyer.extend([], p, 3, ("tenant-b", None))]
    assert all(k in kv.tiers.host for k in b_keys)
    assert set(b_keys) <= set(kv.tiers.disk.stored_keys())
    counts = llm.engine.cache_admin.tier_tenants()
    assert counts["host"][B] == counts["disk"][B] == 6
    assert counts["host"][A] == counts["disk"][A] == 24 - 6  # A keeps only what B leaves
    again = [o.outputs[0].token_ids for o in llm.generate(quiet, ONE, cache_salt="tenant-b")]
    assert again == want[:2]
    outs = llm.generate(quiet, ONE, cache_salt="tenant-b")
    assert all(o.num_cached_tokens == 3 * BS for o in outs)
    view = CacheView({}, llm.engine.cache_admin.hit_rates(), [], counts)
    text = [m for m in cache_metrics("m", view) if m.name == "prefixkv:tenant_tier_blocks"][0]
    samples = {(s.labels["tenant"], s.labels["tier"]): s.value for s in text.samples}
    assert samples[(B, "host")] == 6 and samples[(A, "disk")] == 18


def test_engine_remote_quota_counts_per_tenant(valkey: Any, make_llm: Any, tokens: Any) -> None:
    llm = make_llm(block_size=BS, kv_remote=valkey.url, kv_remote_timeout=5.0,
                   max_cached_blocks_per_tenant=100, kv_blocks_per_tenant="remote=6")
    assert llm.engine.kv.tiers.remote.tenant_quota == 6
    llm.generate([tokens(700, 3 * BS + 1)], ONE, cache_salt="tenant-b")
    llm.generate([tokens(701 + i, 3 * BS + 1) for i in range(5)], ONE, cache_salt="tenant-a")
    assert llm.engine.kv.tiers.flush()
    deadline = time.monotonic() + 5
    while llm.engine.cache_admin.tier_tenants().get("remote", {}).get(A) != 6:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert llm.engine.cache_admin.tier_tenants()["remote"] == {A: 6, B: 3}
