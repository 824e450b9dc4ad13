"""Consistent hashing with bounded loads (CHWBL): KubeAI's prefix router (seed 003).

Each worker owns ``replicas`` virtual nodes on a 64-bit hash ring (xxh64 of ``url#i``). A request
is hashed on its namespace (model, ``cache_salt``) and its first ``prefix_chunks`` route-key
chunks (:mod:`prefixkv.router.keys`: 16 chunks of 16 bytes are the first 256 bytes of the
prompt), and walks the ring clockwise from that point. The first candidate whose load stays
within the bound takes it (reason ``hash``, or ``overflow`` when the walk passed a worker over
its bound). The bound (Mirrokni et al., the rule KubeAI uses): a worker may take the request
when ``load + 1 <= ceil(load_factor * (total_load + 1) / workers)``, loads being requests in
flight over the candidates. So no worker runs more than ``load_factor`` times the average, and
requests that share the hashed prefix land on the same worker while it is not overloaded.

Stateless apart from the ring: nothing is learnt from what was routed, so the router's memory and
CPU per request do not grow with traffic, but two prompts that share more than the hashed prefix
are not told apart from two that share exactly it, and prompts that share less are scattered.
The ring is built once over every worker; a worker out of rotation is skipped on the walk, so
removing (or adding) a worker moves only the keys that worker owns.
"""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import xxhash

from prefixkv.router.policies import Decision, StatelessPolicy, check_candidates

if TYPE_CHECKING:
    from prefixkv.router.keys import RouteKey

__all__ = ["ConsistentHashPolicy", "HashRing"]


def _h64(data: bytes) -> int:
    return xxhash.xxh64_intdigest(data)


class HashRing:
    """``replicas`` virtual nodes per worker on a sorted ring of 64-bit hashes."""

    __slots__ = ("_owners", "_points", "urls")

    def __init__(self, urls: Iterable[str], replicas: int = 100) -> None:
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        self.urls = tuple(dict.fromkeys(urls))
        if not self.urls:
            raise ValueError("urls must name at least one worker")
        nodes = sorted((_h64(f"{url}#{i}".encode()), url)
                       for url in self.urls for i in range(replicas))
        self._points = [p for p, _ in nodes]
        self._owners = [u for _, u in nodes]

    def walk(self, point: int) -> Iterable[str]:
        """Distinct workers clockwise from ``point`` (each once, the owner of ``point`` first)."""
        seen: set[str] = set()
        start = bisect.bisect_left(self._points, point)
        n = len(self._points)
        for i in range(n):
            url = self._owners[(start + i) % n]
            if url not in seen:
                seen.add(url)
                yield url
                if len(seen) == len(self.urls):
                    return


class ConsistentHashPolicy(StatelessPolicy):
    """CHWBL over the workers ``urls`` (module docstring).

    ``load_factor`` >= 1 bounds each worker's in-flight load relative to the average;
    ``prefix_chunks`` >= 1 is how many leading key chunks are hashed; ``replicas`` the virtual
    nodes per worker.
    """

    name = "consistent_hash"

    def __init__(self, urls: Iterable[str], *, load_factor: float = 1.25,
                 prefix_chunks: int = 16, replicas: int = 100) -> None:
        if not load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor!r}")
        if not isinstance(prefix_chunks, int) or isinstance(prefix_chunks, bool) \
                or prefix_chunks < 1:
            raise ValueError(f"prefix_chunks must be an int >= 1, got {prefix_chunks!r}")
        self.load_factor = load_factor
        self.prefix_chunks = prefix_chunks
        self.ring = HashRing(urls, replicas)

    def point(self, key: RouteKey) -> int:
        """Where ``key`` lands on the ring: xxh64 of its namespace and leading chunks."""
        head = key.chunks[: self.prefix_chunks]
        return _h64(repr(key.namespace).encode() + struct.pack(f"<{len(head)}I", *head))

    def bound(self, total_load: int, workers: int) -> int:
        """The most requests in flight a worker may have after taking this one."""
        return math.ceil(self.load_factor * (total_load + 1) / workers)

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        check_candidates(urls)
        candidates = set(urls)
        load = {u: loads.get(u, 0) for u in urls}
        bound = self.bound(sum(load.values()), len(urls))
        first: str | None = None
        for url in self.ring.walk(self.point(key)):
            if url not in candidates:
                continue
            if first is None:
                first = url
            if load[url] + 1 <= bound:
                return Decision(url, "hash" if url == first else "overflow")
        # unreachable for load_factor >= 1 (some worker is at or below the average), kept total:
        # a worker unknown to the ring, or rounding, falls back to the least loaded candidate
        url = min(urls, key=lambda u: load[u])
        return Decision(url, "least_load")
