"""The C runner of whole-leaf eviction steps (``prefixkv/cache/_evict.c``): it frees exactly
what the Python loop frees, in the same order, and leaves the index in the same state; only
the policies whose key order it can read get it."""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest

from prefixkv.cache import BlockPool, HashPrefixCache, RadixPrefixCache
from prefixkv.cache import radix as radix_mod
from prefixkv.cache._native import evict as native_evict
from prefixkv.cache.policies import POLICIES, LRUPolicy

pytestmark = pytest.mark.skipif(native_evict is None, reason="prefixkv.cache._evict is not built")


class StepClock:
    """Advances by one on most calls, stays on some (so some keys tie on their first part).
    ``ints``: returns ints (a user's clock may), so the runner compares items as tuples."""

    def __init__(self, seed: int, ints: bool = False) -> None:
        self.now, self.rng, self.ints = 0, random.Random(seed), ints

    def __call__(self) -> float:
        if self.rng.random() < 0.7:
            self.now += 1
        return self.now if self.ints else float(self.now)


class Counting:
    """Wraps a runner: how many leaves it freed."""

    def __init__(self, run) -> None:  # type: ignore[no-untyped-def]
        self.run, self.freed = run, 0

    def __call__(self, *args):  # type: ignore[no-untyped-def]
        got, freed, orphan = self.run(*args)
        self.freed += freed
        return got, freed, orphan


def _pair(policy: str, bs: int, seed: int, monkeypatch,
          ints: bool = False) -> tuple[RadixPrefixCache, RadixPrefixCache]:
    """Two equal caches: the C runner in the first, the Python loop only in the second."""
    fast = RadixPrefixCache(4096, bs, eviction_policy=policy, clock=StepClock(seed, ints),
                            max_pinned_blocks=64)
    with monkeypatch.context() as m:
        m.setattr(radix_mod, "_evict", None)
        slow = RadixPrefixCache(4096, bs, eviction_policy=policy, clock=StepClock(seed, ints),
                                max_pinned_blocks=64)
    assert fast._evictor._whole is not None and slow._evictor._whole is None
    return fast, slow


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("ints", [False, True], ids=["float-clock", "int-clock"])
def test_the_runner_frees_what_the_python_loop_frees(policy, bs, ints, monkeypatch):
    """Conversations that share system prompts and grow turn by turn (parents left childless,
    split nodes sharing owner tags), matches that lock, pins, and evictions of every size: both
    caches return the same ids in the same order and end in the same state."""
    fast, slow = _pair(policy, bs, 7, monkeypatch, ints)
    counter = Counting(fast._evictor._whole)
    fast._evictor._whole = counter
    rng = random.Random(bs)
    systems = [[rng.randrange(70000) for _ in range(rng.randrange(bs, 40 * bs))] for _ in range(4)]
    chats: list[list[int]] = []
    locked: list[tuple] = []
    for step in range(400):
        r = rng.random()
        if r < 0.45 or not chats:  # a new turn: an old chat grows, or a new chat starts
            if chats and rng.random() < 0.6:
                toks = rng.choice(chats) + [rng.randrange(70000) for _ in range(rng.randrange(1, 30 * bs))]
            else:
                toks = rng.choice(systems) + [rng.randrange(70000) for _ in range(rng.randrange(0, 60 * bs))]
            chats.append(toks)
            results = []
            for cache in (fast, slow):
                m = cache.match_prefix(toks)
                need = len(toks) // bs - len(m.matched_kv_blocks)
                freed = cache.evict(max(0, cache.num_cached_blocks + need - cache.max_blocks))
                new = [b for b in range(cache.max_blocks) if not cache.is_cached(b)][:need]
                results.append(list(freed))
                if len(new) == need:
                    results.append(cache.insert_prefix(toks, [*m.matched_kv_blocks, *new]).kv_block_ids)
            assert results[: len(results) // 2] == results[len(results) // 2 :]
        elif r < 0.6:
            toks = rng.choice(chats)
            locked.append(tuple(c.match_prefix(toks, lock=True) for c in (fast, slow)))
        elif r < 0.7 and locked:
            for c, held in zip((fast, slow), locked.pop(rng.randrange(len(locked)))):
                c.unlock(held)
        elif r < 0.75:
            toks = rng.choice(chats)
            assert fast.pin_prefix(toks) == slow.pin_prefix(toks)
        else:
            n = rng.choice([1, 3, bs, 50, 300, 1000])
            assert list(fast.evict(n)) == list(slow.evict(n))
        if step % 50 == 0:
            fast.check_invariants()
    fast.check_invariants()
    slow.check_invariants()
    counts = [{k: v for k, v in asdict(c.get_stats()).items() if not k.endswith("_us")}
              for c in (fast, slow)]
    assert counts[0] == counts[1]
    assert fast.num_cached_blocks == slow.num_cached_blocks
    assert fast._forest.num_entries == slow._forest.num_entries
    assert fast._forest._cached_tokens == slow._forest._cached_tokens
    assert counter.freed > 20  # the runner did take most whole leaves


def test_the_benchmark_shape_goes_through_the_runner(monkeypatch):
    """Leaves under the root, ten evicted a call (`prefixkv bench ops`): the runner frees the
    whole ones, the ids deepest first, as the Python loop does."""
    fast, slow = _pair("lru", 1, 3, monkeypatch)
    counter = Counting(fast._evictor._whole)
    fast._evictor._whole = counter
    rng = random.Random(0)
    prompts = [[rng.randrange(150000) for _ in range(64)] for _ in range(60)]
    for cache in (fast, slow):
        pool = BlockPool(4096)
        for p in prompts:
            cache.insert_prefix(p, pool.allocate(64) or [])
    for _ in range(5):
        freed = list(fast.evict(640))
        assert freed == list(slow.evict(640)) and len(freed) == 640
    assert counter.freed >= 45
    fast.check_invariants()


def test_only_policies_whose_order_it_reads_get_the_runner():
    """LRU, LFU and FIFO (a key led by a depth-free part); not a subclass that changes the key,
    not a policy with an eviction hook, not the hashed index (its blocks are single entries)."""

    class Reordered(LRUPolicy):
        def key(self, entry):  # type: ignore[no-untyped-def]
            return (-entry.depth, entry.last_access_time)

    class Hooked(LRUPolicy):
        def on_evict(self, entry):  # type: ignore[no-untyped-def]
            pass

    for name in ("lru", "lfu", "fifo"):
        assert RadixPrefixCache(64, 4, eviction_policy=name)._evictor._whole is not None
    for policy in [Reordered(), Hooked(), *(cls() for n, cls in POLICIES.items()
                                             if n not in ("lru", "lfu", "fifo"))]:
        assert RadixPrefixCache(64, 4, eviction_policy=policy)._evictor._whole is None
    assert HashPrefixCache(64, 4)._evictor._whole is None


def test_the_runner_checks_the_classes_it_reads():
    """Built from objects whose classes lack the slots it reads: a TypeError, not a crash."""
    with pytest.raises((TypeError, AttributeError)):
        native_evict.Runner(object(), object(), object(), RadixPrefixCache, None, 1)
