"""Property-based tests of soft retention: random operations against a model.

The model keeps, per cached block (named by its namespace and prefix tokens), the retention
record the rules give it: applied path-wide (the higher priority wins; on a tie the longer TTL
and the later expiry), renewed by every hit (``now + ttl``), gone at its expiry, capped by the
tenant's quota. After every step it checks that the index agrees (retained blocks per tenant)
and, for every eviction (an explicit ``evict`` or the pool's, making room for an insert):

* a retained block was evicted only when every block that could be freed without touching a
  retained block (a block whose whole cached subtree is unretained, unpinned) was freed too;
* a retained block of priority ``p`` only when every block whose subtree holds only lower
  priorities (or none) was freed too;
* no pinned block, and only leaves (as the oracle of ``test_properties.py`` checks).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixkv.cache import BlockPool, HashPrefixCache, RadixPrefixCache, Retention
from prefixkv.cache.policies import POLICIES

NUM_BLOCKS = 20
QUOTA = 7
tokens = st.lists(st.integers(0, 2), max_size=12)
retention = st.one_of(st.none(), st.tuples(st.integers(0, 3), st.sampled_from([2.0, 5.0, 9.0])))
op = st.one_of(
    st.tuples(st.just("insert"), tokens, st.sampled_from([None, "t"]), retention),
    st.tuples(st.just("match"), tokens, st.sampled_from([None, "t"])),
    st.tuples(st.just("retain"), tokens, st.sampled_from([None, "t"]),
              st.tuples(st.integers(0, 3), st.sampled_from([2.0, 5.0, 9.0]))),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 3.0])),
    st.tuples(st.just("pin"), tokens),
    st.tuples(st.just("evict"), st.integers(0, 6)),
)


class Model:
    def __init__(self, bs: int) -> None:
        self.bs = bs
        self.now = 0.0
        self.cached: dict[tuple, int] = {}  # (ns, prefix) -> block id
        self.rec: dict[tuple, tuple[int, float, float]] = {}  # key -> (priority, ttl, expiry)
        self.pins: set[tuple] = set()

    def keys(self, ns, toks):
        return [(ns, tuple(toks[: (j + 1) * self.bs])) for j in range(len(toks) // self.bs)]

    def matched(self, ns, toks):
        out = []
        for key in self.keys(ns, toks):
            if key not in self.cached:
                break
            out.append(key)
        return out

    def live(self, key):
        r = self.rec.get(key)
        return r if r is not None and r[2] > self.now else None

    def expire(self):
        self.rec = {k: r for k, r in self.rec.items() if r[2] > self.now}

    def hit(self, keys):
        for k in keys:
            r = self.live(k)
            if r is not None:
                self.rec[k] = (r[0], r[1], self.now + r[1])

    def retain(self, ns, keys, prio, ttl, quota) -> bool:
        self.expire()
        new = sum(1 for k in keys if k not in self.rec)
        if sum(1 for k in self.rec if k[0] == ns) + new > quota:
            return False
        for k in keys:
            old = self.rec.get(k)
            asked = (prio, ttl, self.now + ttl)
            if old is None or asked[0] > old[0]:
                self.rec[k] = asked
            elif asked[0] == old[0]:
                self.rec[k] = (old[0], max(old[1], ttl), max(old[2], asked[2]))
        return True

    def subtree(self, key):
        ns, toks = key
        return [k for k in self.cached if k[0] == ns and k[1][: len(toks)] == toks]

    def rank(self, key) -> int:
        r = self.live(key)
        return -1 if r is None else r[0]

    def check_evicted(self, freed_keys, locked=frozenset()):
        """The rules of the module doc for one eviction (state as before it; ``locked``: the
        blocks a request holds meanwhile)."""
        freed = set(freed_keys)
        assert not freed & set(locked), "evicted a locked block"
        for k in freed:
            assert k not in self.pins and all(
                p[0] != k[0] or p[1][: len(k[1])] != k[1] for p in self.pins), "evicted a pin"
        top = max((self.rank(k) for k in freed), default=-1)
        if top < 0:
            self.check_quota(freed, self.pinned_cover() | set(locked))
            return
        held = self.pinned_cover() | set(locked)
        self.check_quota(freed, held)
        for k in self.cached:  # every block freeable below rank `top` went first
            sub = self.subtree(k)
            if all(self.rank(s) < top and s not in held for s in sub):
                assert k in freed, f"{k} (rank {self.rank(k)}) kept, a rank {top} block evicted"

    def check_quota(self, freed, held):
        """A tenant within its quota lost a block only if every tenant over its quota lost its
        excess, or every block it could lose without touching a retained or held one."""
        if not any(self.count(k[0]) <= QUOTA for k in freed):
            return
        for ns in {k[0] for k in self.cached}:
            excess = self.count(ns) - QUOTA
            if excess <= 0 or sum(1 for k in freed if k[0] == ns) >= excess:
                continue
            for k in self.cached:
                if k[0] == ns and k not in freed and all(
                        self.rank(s) < 0 and s not in held for s in self.subtree(k)):
                    raise AssertionError(f"tenant {ns!r} over quota kept {k}")

    def count(self, ns) -> int:
        return sum(1 for k in self.cached if k[0] == ns)

    def pinned_cover(self):
        return {k for k in self.cached for p in self.pins if p[0] == k[0] and p[1][: len(k[1])] == k[1]}

    def forget(self, keys):
        for k in keys:
            del self.cached[k]
            self.rec.pop(k, None)


def run(cache, bs, ops, clock):
    pool = BlockPool(NUM_BLOCKS)
    model = Model(bs)
    for o in ops:
        kind = o[0]
        if kind == "tick":
            clock[0] += o[1]
            model.now = clock[0]
        elif kind == "insert":
            _, toks, ns, ret = o
            nb = len(toks) // bs
            m = cache.match_prefix(toks, namespace=ns, lock=True)
            model.hit(model.matched(ns, toks))
            before = dict(model.cached)
            locked = set(model.matched(ns, toks))
            if m.partial_tokens:
                src = next(k for k, b in before.items() if b == m.partial_block_id)
                locked |= {k for k in before if k[0] == src[0] and src[1][: len(k[1])] == k[1]}
            new = pool.allocate(nb - len(m.matched_kv_blocks), evict_from=cache)
            gone = [k for k, b in before.items() if not cache.is_cached(b)]
            model.check_evicted(gone, locked)
            model.forget(gone)
            if new is None:
                cache.unlock(m)
                continue
            r = None if ret is None else Retention(priority=ret[0], ttl_s=ret[1])
            node = cache.insert_prefix(toks, [*m.matched_kv_blocks, *new], namespace=ns,
                                       retention=r)
            cache.unlock(m)
            pool.free(node.returned_block_ids)
            keys = model.keys(ns, toks)
            for key, bid in zip(keys, node.kv_block_ids):
                model.cached.setdefault(key, bid)
            model.hit(keys)
            if r is not None and keys:
                model.retain(ns, keys, r.priority, r.ttl_s, QUOTA)
        elif kind == "match":
            _, toks, ns = o
            m = cache.match_prefix(toks, namespace=ns)
            keys = model.matched(ns, toks)
            assert m.match_length == len(keys) * bs
            model.hit(keys)
        elif kind == "retain":
            _, toks, ns, (prio, ttl) = o
            keys = model.matched(ns, toks)
            ok = model.retain(ns, keys, prio, ttl, QUOTA) if keys else True
            try:
                got = cache.retain(toks, Retention(priority=prio, ttl_s=ttl), namespace=ns)
                assert ok and got == len(keys)
            except ValueError:
                assert not ok
        elif kind == "pin":
            toks = o[1]
            keys = model.matched(None, toks)
            if keys and len(keys) == len(toks) // bs and cache.pin_prefix(toks):
                model.pins.add(keys[-1])
        elif kind == "evict":
            by_id = {b: k for k, b in model.cached.items()}
            ids = cache.evict(o[1])
            freed = [by_id[b] for b in ids]
            model.check_evicted(freed)
            model.forget(freed)
            pool.free(ids)
        cache.check_invariants()
        model.expire()
        assert {b for b in range(NUM_BLOCKS) if cache.is_cached(b)} == set(model.cached.values())
        per_ns: dict = {}
        for k in model.rec:
            per_ns[k[0]] = per_ns.get(k[0], 0) + 1
        assert {t: u.retained_blocks for t, u in cache.tenants().items() if u.retained_blocks} == per_ns
        assert cache.get_stats().retained_blocks == len(model.rec)
        assert {t: u.cached_blocks for t, u in cache.tenants().items() if u.cached_blocks} == {
            ns: model.count(ns) for ns in {k[0] for k in model.cached}}


SETTINGS = settings(max_examples=int(os.environ.get("PREFIXKV_HYPOTHESIS_EXAMPLES", "150")),
                    deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(op, max_size=40), st.sampled_from([1, 2, 3]), st.sampled_from(["lru", "fifo"]))
def test_radix_retention_against_model(ops, bs, policy):
    clock = [0.0]
    run(RadixPrefixCache(NUM_BLOCKS, bs, eviction_policy=policy, max_pinned_blocks=5,
                         clock=lambda: clock[0], max_blocks_per_tenant=QUOTA), bs, ops, clock)


@SETTINGS
@given(st.lists(op, max_size=40), st.sampled_from([1, 2]))
def test_hash_retention_against_model(ops, bs):
    clock = [0.0]
    run(HashPrefixCache(NUM_BLOCKS, bs, max_pinned_blocks=5, clock=lambda: clock[0],
                        max_blocks_per_tenant=QUOTA), bs, ops, clock)


@SETTINGS
@given(st.lists(op, max_size=40), st.sampled_from(sorted(set(POLICIES) - {"lru", "fifo"})))
def test_other_policies_retention_against_model(ops, policy):
    clock = [0.0]
    run(RadixPrefixCache(NUM_BLOCKS, 2, eviction_policy=policy, max_pinned_blocks=5,
                         clock=lambda: clock[0], max_blocks_per_tenant=QUOTA), 2, ops, clock)
