"""Trace replay with KV tiers below the pool: what host memory, disk or a shared store is worth.

``replay_tiered`` replays a trace through the cache core as :func:`prefixkv.bench.trace.replay`
does (the pool is tier 0, a real index with LRU), and below it LRU tiers of block ids, as the
engine's tiers (docs/tiers.md) behave: a block evicted from a tier goes down to the next (write
back), and a request's blocks past its pool match are looked up tier by tier, in order, as long
as consecutive blocks are found; the found ones are loaded into the pool (promoted) and only the
rest is prefilled. Trace hash ids name a block together with its whole prefix, so they are the
tiers' keys.

The cost model answers "how much is a tier worth": prefilling a token costs
``1 / prefill_tokens_per_s`` seconds, loading it from tier ``t`` costs ``kv_bytes_per_token /
bandwidth[t]``; the report gives the prefill time of the whole trace with no cache, with the
pool alone, and with the tiers (compute + loads).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from prefixkv.bench.trace import TraceRequest, clock_times
from prefixkv.cache import BlockPool, RadixPrefixCache


@dataclass(frozen=True, slots=True)
class TierRow:
    """One tiered replay: token hit rate per tier (tier 0 is the pool) and the cost model."""

    capacities_tokens: tuple[int, ...]
    hit_rates: tuple[float, ...]
    hit_rate: float
    input_tokens: int
    prefill_s_no_cache: float
    prefill_s_pool_only: float
    prefill_s_tiered: float
    load_s: float


def replay_tiered(
    requests: Sequence[TraceRequest],
    capacities_tokens: Sequence[int],
    *,
    block_size: int = 512,
    bandwidths_gbps: Sequence[float] = (),
    prefill_tokens_per_s: float = 4000.0,
    kv_bytes_per_token: int = 524288,
    clock: str = "timestamp",
) -> TierRow:
    """Replay with ``capacities_tokens[0]`` tokens of pool and one LRU tier per further entry.

    ``bandwidths_gbps[i]`` is the load bandwidth of tier ``i + 1`` in GB/s (missing entries:
    25, 3, 1 GB/s for host, disk, remote). ``ValueError`` names a bad argument.
    """
    if not capacities_tokens or any(c < block_size for c in capacities_tokens):
        raise ValueError(f"capacities_tokens must be >= one block ({block_size}) each, "
                         f"got {list(capacities_tokens)}")
    if prefill_tokens_per_s <= 0 or kv_bytes_per_token <= 0:
        raise ValueError("prefill_tokens_per_s and kv_bytes_per_token must be > 0")
    defaults = (25.0, 3.0, 1.0)
    bw = [bandwidths_gbps[i] if i < len(bandwidths_gbps) else defaults[min(i, 2)]
          for i in range(len(capacities_tokens) - 1)]
    if any(b <= 0 for b in bw):
        raise ValueError(f"bandwidths_gbps must be > 0, got {list(bandwidths_gbps)}")
    blocks = capacities_tokens[0] // block_size
    lower: list[OrderedDict[int, None]] = [OrderedDict() for _ in capacities_tokens[1:]]
    lower_cap = [c // block_size for c in capacities_tokens[1:]]
    times = clock_times(requests, clock)
    now = [0.0]
    cache = RadixPrefixCache(blocks, 1, max_pinned_blocks=0, clock=lambda: now[0])
    pool = BlockPool(blocks)
    key_of: dict[int, int] = {}  # pool block id -> trace hash id

    def spill(hash_id: int, tier: int) -> None:
        while tier < len(lower):
            store = lower[tier]
            store[hash_id] = None
            store.move_to_end(hash_id)
            if len(store) <= lower_cap[tier]:
                return
            hash_id, _ = store.popitem(last=False)  # its LRU block goes one tier down
            tier += 1

    hits = [0] * len(capacities_tokens)
    input_tokens = 0
    for i, r in enumerate(requests):
        now[0] = times[i]
        ids = list(r.hash_ids)
        m = cache.match_prefix(ids, lock=True)
        k = len(m.matched_kv_blocks)
        found = [0] * len(capacities_tokens)
        found[0] = k
        j = k
        while j < len(ids):
            tier = next((t for t, s in enumerate(lower) if ids[j] in s), None)
            if tier is None:
                break
            lower[tier].move_to_end(ids[j])
            found[tier + 1] += 1
            j += 1
        n = min(len(ids), blocks) - k  # loaded + prefilled blocks that go into the pool
        short = n - pool.num_free
        if short > 0:
            freed = cache.evict(short)
            for b in freed:
                spill(key_of.pop(b), 0)
            pool.free(freed)
        new = pool.allocate(max(n, 0))
        if new is None:
            raise RuntimeError(f"request {i}: could not allocate {n} blocks")
        if n > 0:
            node = cache.insert_prefix(ids[: k + n], [*m.matched_kv_blocks, *new])
            for h, b in zip(ids, node.kv_block_ids):
                key_of[b] = h
            pool.free(node.returned_block_ids)
        cache.unlock(m)
        budget = r.input_length
        for t, f in enumerate(found):  # a request's last block may be partial
            got = min(f * block_size, budget)
            hits[t] += got
            budget -= got
        input_tokens += r.input_length
    per_token = 1.0 / prefill_tokens_per_s
    load_s = sum(hits[t + 1] * kv_bytes_per_token / (bw[t] * 1e9) for t in range(len(bw)))
    return TierRow(
        capacities_tokens=tuple(capacities_tokens),
        hit_rates=tuple(h / input_tokens for h in hits),
        hit_rate=sum(hits) / input_tokens,
        input_tokens=input_tokens,
        prefill_s_no_cache=input_tokens * per_token,
        prefill_s_pool_only=(input_tokens - hits[0]) * per_token,
        prefill_s_tiered=(input_tokens - sum(hits)) * per_token + load_s,
        load_s=load_s,
    )


def format_tier_row(row: TierRow, unbounded: float | None) -> str:
    """The report of one tiered replay (``unbounded``: an unbounded cache's hit rate)."""
    names = ["pool"] + [f"tier {t}" for t in range(1, len(row.capacities_tokens))]
    lines = [f"{name:>7}: {cap:>14,} tokens, token hit rate {rate:.3f}"
             for name, cap, rate in zip(names, row.capacities_tokens, row.hit_rates)]
    share = f" ({row.hit_rate / unbounded:.2f} of unbounded {unbounded:.3f})" if unbounded else ""
    lines.append(f"  total: hit rate {row.hit_rate:.3f}{share}")
    lines.append(f"prefill time: {row.prefill_s_no_cache:,.0f} s without a cache, "
                 f"{row.prefill_s_pool_only:,.0f} s with the pool alone, "
                 f"{row.prefill_s_tiered:,.0f} s with the tiers (of which loads {row.load_s:,.0f} s)")
    return "\n".join(lines)
