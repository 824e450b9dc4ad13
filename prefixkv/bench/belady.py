"""Belady's offline optimum as an eviction policy of the cache core (``belady`` in the bench).

Belady (1966): evict the block whose next use lies farthest in the future. Here it is a
plain :class:`~prefixkv.cache.EvictionPolicy` that was given the whole trace up front, so it
runs through the same index, pool, locks and leaves-first eviction as every online policy:

* a block's identity is its trace hash id (the replay's index runs at block size 1 over
  ``hash_ids``, so an entry's deepest "token" is its deepest block's hash id);
* its next use is the first request *after the entry's last access* whose ``hash_ids``
  contain it (``inf`` if none); the key is ``(-next_use, -depth, tick)``, so among blocks used
  again at the same time the deeper one goes first, which keeps the cached set prefix closed.

It is optimal in *blocks* (no policy matched more blocks on 1,200 random traces, both
indexes); in tokens it can lose by a few tokens to a policy that happened to keep a request's
partial last block, which is worth less than ``block_size`` tokens.

What the cache core imposes (and the Mooncake README's reference figures did not): the blocks
of the request being served are never candidates (matched blocks are locked, new ones are
inserted after the eviction), i.e. no bypass. On the conversation trace this gives 0.2516 /
0.3585 at 1M / 3M tokens against the reference 0.254 / 0.357, whose simulation could evict a
request's own new blocks (bypass, +0.004 at 1M) but broke ties by the smaller hash id, i.e.
the shallower block first (-0.004 at 1M). docs/benchmarks.md tabulates all four variants.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

from prefixkv.cache.policies import CacheEntry, EvictionPolicy
from prefixkv.cache.radix_node import key_tokens

_INF = float("inf")


class BeladyPolicy(EvictionPolicy):
    """Farthest next use first, deeper first on ties. Needs the future; one replay per object.

    Args:
        uses: for each block id (hash id), the sorted clock times of the requests using it.
            The index's clock must report exactly those times while each request is served.
    """

    name = "belady"

    def __init__(self, uses: dict[int, list[float]]) -> None:
        self._uses = uses

    @classmethod
    def for_trace(cls, requests: Sequence[Any], times: Sequence[float]) -> BeladyPolicy:
        """Build from requests with ``hash_ids`` and the clock time each is served at."""
        if len(times) != len(requests):
            raise ValueError(f"times has {len(times)} values for {len(requests)} requests")
        uses: dict[int, list[float]] = {}
        for r, t in zip(requests, times):
            for h in r.hash_ids:
                uses.setdefault(h, []).append(t)
        return cls(uses)

    def next_use(self, block: int, after: float) -> float:
        """Clock time of the first use of ``block`` strictly after ``after`` (``inf``: none)."""
        times = self._uses.get(block)
        if not times:
            return _INF
        j = bisect_right(times, after)
        return times[j] if j < len(times) else _INF

    def key(self, entry: CacheEntry) -> Any:
        return (-self.next_use(_tail_token(entry), entry.last_access_time), -entry.depth,
                entry.tick)


def _tail_token(entry: Any) -> int:
    """The deepest block's token of a radix node (``key``) or hashed block (``tokens``)."""
    tokens = getattr(entry, "tokens", None)
    if tokens is None:
        tokens = key_tokens(entry.key)
    return int(tokens[-1])
