"""Thread safety: concurrent match/insert/evict keep every invariant (one lock per index)."""

from __future__ import annotations

import random
import threading

import pytest

from prefixkv.cache import BlockPool, HashPrefixCache, RadixPrefixCache


@pytest.mark.parametrize("cls, bs", [(RadixPrefixCache, 1), (RadixPrefixCache, 4), (HashPrefixCache, 4)])
def test_concurrent_clients(cls, bs):
    cache = cls(256, bs)
    pool = BlockPool(256)
    pool_lock = threading.Lock()
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                toks = [rng.randrange(3) for _ in range(rng.randrange(0, 6 * bs))]
                m = cache.match_prefix(toks, lock=True)
                with pool_lock:
                    new = pool.allocate(len(toks) // bs - len(m.matched_kv_blocks), evict_from=cache)
                if new is not None:
                    node = cache.insert_prefix(toks, [*m.matched_kv_blocks, *new])
                    with pool_lock:
                        pool.free(node.returned_block_ids)
                cache.unlock(m)
        except BaseException as exc:  # noqa: BLE001 - surface in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    cache.check_invariants()
    assert cache.get_stats().locked_blocks == 0
    assert pool.num_free + cache.num_cached_blocks == 256
