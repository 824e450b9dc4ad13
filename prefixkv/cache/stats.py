"""Counters every index keeps, and the arithmetic that turns them into :class:`CacheStats`."""

from __future__ import annotations

from dataclasses import dataclass

from prefixkv.cache.protocol import CacheStats


@dataclass(slots=True)
class Counters:
    """Running totals since construction or the last ``reset_stats``."""

    queries: int = 0
    hits: int = 0
    queried_tokens: int = 0
    matched_tokens: int = 0
    partial_tokens: int = 0
    inserts: int = 0
    evictions: int = 0
    evicted_blocks: int = 0
    match_ns: int = 0
    retentions_refused: int = 0

    def record_query(self, num_tokens: int, match_length: int, partial: int,
                     elapsed_ns: int = 0) -> None:
        """Count one ``match_prefix`` call (``elapsed_ns``: its time inside the index)."""
        self.queries += 1
        self.match_ns += elapsed_ns
        self.queried_tokens += num_tokens
        if match_length > 0:
            self.hits += 1
            self.matched_tokens += match_length
        self.partial_tokens += partial

    def snapshot(
        self,
        *,
        index: str,
        block_size: int,
        max_blocks: int,
        cached_blocks: int,
        pinned_blocks: int,
        locked_blocks: int,
        evictable_blocks: int,
        num_nodes: int,
        memory_bytes: int,
        policy: str,
        retained_blocks: int = 0,
    ) -> CacheStats:
        """Freeze the counters together with the index's current sizes."""
        return CacheStats(
            index=index,
            block_size=block_size,
            max_blocks=max_blocks,
            queries=self.queries,
            hits=self.hits,
            query_hit_rate=self.hits / self.queries if self.queries else 0.0,
            queried_tokens=self.queried_tokens,
            matched_tokens=self.matched_tokens,
            partial_tokens=self.partial_tokens,
            token_hit_rate=self.matched_tokens / self.queried_tokens if self.queried_tokens else 0.0,
            avg_match_length=self.matched_tokens / self.hits if self.hits else 0.0,
            avg_match_us=self.match_ns / self.queries / 1000 if self.queries else 0.0,
            inserts=self.inserts,
            cached_blocks=cached_blocks,
            pinned_blocks=pinned_blocks,
            locked_blocks=locked_blocks,
            evictable_blocks=evictable_blocks,
            free_blocks=max_blocks - cached_blocks,
            evictions=self.evictions,
            evicted_blocks=self.evicted_blocks,
            num_nodes=num_nodes,
            memory_bytes=memory_bytes,
            policy=policy,
            retained_blocks=retained_blocks,
            retentions_refused=self.retentions_refused,
        )
