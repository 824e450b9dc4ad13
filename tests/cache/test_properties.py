"""Property-based tests: random operation sequences against a brute-force oracle.

The oracle knows which block-aligned prefixes are cached (and under which id), which are locked
or pinned. After every operation we check: match length equals the oracle's longest cached
prefix; every evicted block was an unlocked, unpinned leaf; every block id is owned exactly once
(pool free + cached + caller-private = the whole pool); the index's own invariants hold.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixkv.cache import BlockPool, HashPrefixCache, RadixPrefixCache
from prefixkv.cache.held_ids import BULK
from prefixkv.cache.policies import POLICIES

NUM_BLOCKS = 24

op = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 2), max_size=14), st.sampled_from([None, "t"])),
    st.tuples(st.just("match"), st.lists(st.integers(0, 2), max_size=14), st.booleans()),
    st.tuples(st.just("unlock"), st.integers(0, 20)),
    st.tuples(st.just("pin"), st.lists(st.integers(0, 2), max_size=10)),
    st.tuples(st.just("unpin"), st.integers(0, 20)),
    st.tuples(st.just("evict"), st.integers(0, 6)),
)


class Oracle:
    def __init__(self, bs: int) -> None:
        self.bs = bs
        self.cached: dict[tuple, int] = {}  # (ns, prefix tokens of k full blocks) -> id
        self.locks: list[tuple] = []  # locked prefix keys (ns, tokens)
        self.pins: list[tuple] = []

    def keys(self, ns, tokens):
        bs = self.bs
        return [(ns, tuple(tokens[: (j + 1) * bs])) for j in range(len(tokens) // bs)]

    def longest(self, ns, tokens) -> int:
        k = 0
        for key in self.keys(ns, tokens):
            if key not in self.cached:
                break
            k += 1
        return k

    def covered(self, key, prefixes) -> bool:
        ns, toks = key
        return any(p[0] == ns and p[1][: len(toks)] == toks for p in prefixes)

    def is_leaf(self, key) -> bool:
        ns, toks = key
        return not any(k[0] == ns and len(k[1]) > len(toks) and k[1][: len(toks)] == toks
                       for k in self.cached)


def run(cache, bs, ops, num_blocks=NUM_BLOCKS):
    pool = BlockPool(num_blocks)
    oracle = Oracle(bs)
    handles = []
    pins = []
    for o in ops:
        kind = o[0]
        if kind == "insert":
            _, toks, ns = o
            nb = len(toks) // bs
            # as the engine does: the matched blocks stay locked while the pool evicts for the
            # rest (an unlocked match may be evicted, and its ids handed out again)
            m = cache.match_prefix(toks, namespace=ns, lock=True)
            reuse = m.matched_kv_blocks
            need = nb - len(reuse)
            new = pool.allocate(need, evict_from=cache)
            if new is None:
                cache.unlock(m)
                continue
            for key in oracle.keys(ns, toks):
                pass
            # oracle: drop whatever the pool's eviction took
            for key, bid in list(oracle.cached.items()):
                if not cache.is_cached(bid):
                    assert not oracle.covered(key, oracle.locks) and not oracle.covered(key, oracle.pins)
                    del oracle.cached[key]
            node = cache.insert_prefix(toks, [*reuse, *new], namespace=ns)
            cache.unlock(m)
            pool.free(node.returned_block_ids)
            for key, bid in zip(oracle.keys(ns, toks), node.kv_block_ids):
                assert oracle.cached.setdefault(key, bid) == bid
        elif kind == "match":
            _, toks, lock = o
            ns = None
            m = cache.match_prefix(toks, lock=lock)
            k = oracle.longest(ns, toks)
            assert m.match_length == k * bs
            assert list(m.matched_kv_blocks) == [oracle.cached[key] for key in oracle.keys(ns, toks)[:k]]
            if lock:
                covered = toks[: k * bs + (bs if m.partial_tokens else 0)]
                if m.partial_tokens:
                    # the source block's own tokens: the cached prefix that owns partial_block_id
                    covered = next(key[1] for key, b in oracle.cached.items()
                                   if b == m.partial_block_id)
                handles.append((m, (ns, tuple(covered))))
                oracle.locks.append((ns, tuple(covered)))
        elif kind == "unlock" and handles:
            m, key = handles.pop(o[1] % len(handles))
            cache.unlock(m)
            oracle.locks.remove(key)
        elif kind == "pin":
            toks = o[1]
            nb = len(toks) // bs
            ok = cache.pin_prefix(toks)
            fully = nb > 0 and oracle.longest(None, toks) == nb
            if ok:
                assert fully
                key = (None, tuple(toks[: nb * bs]))
                if key not in pins:
                    pins.append(key)
                    oracle.pins.append(key)
            elif fully:
                assert "max_pinned_blocks" in cache.last_pin_error
        elif kind == "unpin" and pins:
            key = pins.pop(o[1] % len(pins))
            assert cache.unpin_prefix(list(key[1]), namespace=key[0])
            oracle.pins.remove(key)
        elif kind == "evict":
            freed = cache.evict(o[1])
            by_id = {b: k for k, b in oracle.cached.items()}
            for b in freed:
                key = by_id[b]
                assert not oracle.covered(key, oracle.locks), "evicted a locked block"
                assert not oracle.covered(key, oracle.pins), "evicted a pinned block"
                assert oracle.is_leaf(key), "evicted a block another cached block depends on"
                del oracle.cached[key]
            pool.free(freed)
        # ---- invariants after every step
        cache.check_invariants()
        assert set(oracle.cached.values()) == {b for b in range(num_blocks) if cache.is_cached(b)}
        free = {b for b in range(num_blocks) if pool.is_free(b)}
        cached = set(oracle.cached.values())
        assert not free & cached
        assert len(free) + len(cached) == num_blocks  # no caller-private ids between steps
        # locks and pins cover exactly what the oracle says (no over- or under-locking)
        stats = cache.get_stats()
        assert stats.locked_blocks == sum(oracle.covered(k, oracle.locks) for k in oracle.cached)
        assert stats.pinned_blocks == sum(oracle.covered(k, oracle.pins) for k in oracle.cached)
        # the cached set is prefix-closed
        for ns, toks in oracle.cached:
            for j in range(bs, len(toks), bs):
                assert (ns, toks[:j]) in oracle.cached


SETTINGS = settings(max_examples=int(os.environ.get("PREFIXKV_HYPOTHESIS_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(op, max_size=40), st.sampled_from([1, 2, 3]))
def test_radix_against_oracle(ops, bs):
    run(RadixPrefixCache(NUM_BLOCKS, bs, max_pinned_blocks=6), bs, ops)


def _scaled(ops, factor):
    """The same operations with every token id multiplied (2 * 35,000 > 2**16: the radix tree
    widens its keys mid-run, the first time such an id is inserted)."""
    return [(o[0], [t * factor for t in o[1]], *o[2:]) if o[0] in ("insert", "match", "pin")
            else o for o in ops]


@SETTINGS
@given(st.lists(op, max_size=40), st.sampled_from([1, 2, 3]))
def test_radix_with_large_token_ids_against_oracle(ops, bs):
    run(RadixPrefixCache(NUM_BLOCKS, bs, max_pinned_blocks=6), bs, _scaled(ops, 35_000))


def _mapped(ops, ids):
    """The same operations with token ``t`` replaced by ``ids[t]``."""
    return [(o[0], [ids[t] for t in o[1]], *o[2:]) if o[0] in ("insert", "match", "pin")
            else o for o in ops]


@SETTINGS
@given(st.lists(op, max_size=40), st.sampled_from([4, 8]),
       st.sampled_from([(7, 70_000, 2**18 - 1), (7, 70_000, 2**18), (2**18 + 5, 7, 65_536)]))
def test_radix_packed_keys_against_oracle(ops, bs, ids):
    """Block sizes that are multiples of 4 pack keys 18 bits a token once an id >= 2**16 is
    inserted (when the C helper is built), and widen again to 4 bytes at the first id >= 2**18:
    every transition, mid-run, against the oracle."""
    run(RadixPrefixCache(NUM_BLOCKS, bs, max_pinned_blocks=6), bs, _mapped(ops, ids))


@SETTINGS
@given(st.lists(op, max_size=40), st.sampled_from([1, 2, 3]), st.sampled_from(["sha256", "builtin"]))
def test_hash_against_oracle(ops, bs, algo):
    run(HashPrefixCache(NUM_BLOCKS, bs, hash_algo=algo, max_pinned_blocks=6), bs, ops)


@SETTINGS
@given(st.lists(op, max_size=40), st.sampled_from([1, 2]))
def test_hash_with_frequent_collisions_against_oracle(ops, bs):
    """A 3-valued hash: collisions everywhere; verified hits keep the oracle's answers."""
    cache = HashPrefixCache(NUM_BLOCKS, bs, hash_algo="builtin", max_pinned_blocks=6)
    cache._hasher = lambda parent, tokens, extra: hash((parent, tuple(tokens), extra)) % 3
    run(cache, bs, ops)


# ---- block size 1, eviction heavy: long leaves (past the bulk-claim threshold), large evictions,
# a coarse clock (many equal access times, so the deeper-first tie-break decides)
BIG_POOL = 320
long_op = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 2), min_size=BULK - 8, max_size=130),
              st.sampled_from([None, "t"])),
    st.tuples(st.just("match"), st.lists(st.integers(0, 2), max_size=130), st.booleans()),
    st.tuples(st.just("unlock"), st.integers(0, 20)),
    st.tuples(st.just("pin"), st.lists(st.integers(0, 2), max_size=60)),
    st.tuples(st.just("unpin"), st.integers(0, 20)),
    st.tuples(st.just("evict"), st.integers(0, 160)),
)


class CoarseClock:
    """Advances by 1 every third call: many entries share an access time."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return float(self.calls // 3)


@SETTINGS
@given(st.lists(long_op, max_size=30), st.sampled_from(sorted(POLICIES)))
def test_radix_bs1_eviction_heavy_against_oracle(ops, policy):
    cache = RadixPrefixCache(BIG_POOL, 1, max_pinned_blocks=80, eviction_policy=policy,
                             clock=CoarseClock())
    run(cache, 1, ops, BIG_POOL)


RUN_POLICIES = sorted(name for name, cls in POLICIES.items() if cls.depth_monotone_keys)


def _per_block(policy_name: str):
    """The same policy with run eviction off: the reference per-block order."""
    cls = POLICIES[policy_name]
    return type(f"PerBlock{cls.__name__}", (cls,), {"depth_monotone_keys": False})()


class FineClock:
    """Advances by 1 on every call: keys differ in their first part (the C runner's steps)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@SETTINGS
@given(st.lists(long_op, max_size=30), st.sampled_from(RUN_POLICIES), st.sampled_from([1, 3]),
       st.sampled_from(["radix", "hash"]), st.sampled_from([CoarseClock, FineClock]))
def test_run_eviction_frees_exactly_the_per_block_order(ops, policy, bs, index, clock):
    """Freeing a leaf's run (and then its parent, when it goes next) in one step, in C where
    the runner is built, returns the same ids, in the same order, as trimming one block at a
    time and re-filing every entry."""
    def make(p):
        if index == "radix":
            return RadixPrefixCache(BIG_POOL, bs, eviction_policy=p, clock=clock())
        return HashPrefixCache(BIG_POOL, bs, hash_algo="builtin", eviction_policy=p,
                               clock=clock())

    fast, slow = make(policy), make(_per_block(policy))
    assert fast.policy.depth_monotone_keys and not slow.policy.depth_monotone_keys
    for o in ops:
        if o[0] == "insert":
            toks, ns = o[1], o[2]
            nb = len(toks) // bs
            got = []
            for cache in (fast, slow):
                m = cache.match_prefix(toks, namespace=ns)
                need = nb - len(m.matched_kv_blocks)
                got.append(cache.evict(max(0, cache.num_cached_blocks + need - BIG_POOL)))
                new = [b for b in range(BIG_POOL) if not cache.is_cached(b)][:need]
                if len(new) == need:
                    got.append(cache.insert_prefix(toks, [*m.matched_kv_blocks, *new],
                                                   namespace=ns).kv_block_ids)
            assert got[: len(got) // 2] == got[len(got) // 2 :]
        elif o[0] == "match":
            assert (fast.match_prefix(o[1]).matched_kv_blocks
                    == slow.match_prefix(o[1]).matched_kv_blocks)
        elif o[0] == "evict":
            assert fast.evict(o[1]) == slow.evict(o[1])
        fast.check_invariants()
    assert fast.get_stats().evictions == slow.get_stats().evictions
