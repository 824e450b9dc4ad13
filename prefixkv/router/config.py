"""The router's settings: :class:`RouterConfig`, validated once when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixkv.cache import POLICIES
from prefixkv.router.keys import DEFAULT_CHUNK_BYTES
from prefixkv.router.policies import POLICY_NAMES
from prefixkv.router.workers import normalize_worker_url

__all__ = ["KEEP_ALIVE_S", "RouterConfig"]

KEEP_ALIVE_S = 20
"""The default ``timeout_keep_alive``: longer than clients keep an idle connection (httpx 5 s,
aiohttp 15 s), so none sends on one the router is closing (``prefixkv.cli.serve.KEEP_ALIVE_S``)."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the router needs, validated once (``ValueError`` naming the bad field).

    Times are in seconds. ``max_tree_size`` is in prompt bytes (each tree holds
    ``max_tree_size // chunk_bytes`` key chunks); ``eviction_interval == 0`` trims the trees
    after every insert; ``simulate_eviction`` bounds them by each worker's KV capacity
    (``capacity_tokens``, else the worker's stats) and trims after every insert, in the order of
    ``worker_eviction_policy`` (else each worker's policy from its stats, else LRU).
    ``load_factor``, ``hash_prefix_chunks`` and ``hash_replicas`` configure ``consistent_hash``.
    ``failure_threshold`` failed dispatches in a row open a worker's breaker.
    ``timeout_keep_alive``: how long the router keeps a client's idle connection open
    (:data:`KEEP_ALIVE_S`).
    ``admin_api_key``: the fleet's admin key, needed for the router's cache admin routes and
    sent on to the workers (and with the stats reads); see :mod:`prefixkv.router.admin`.
    ``kv_events`` / ``kv_events_topic``: the ``precise`` policy's event endpoints, one per worker
    (``auto``: discovered, the default; ``none``; ``ENDPOINT[|REPLAY]``); ``kv_events_rehash``:
    derive prefixkv's block hashes from the events' tokens (workers with other hashes: vLLM);
    ``kv_tier_weights``: what a block held in a lower tier is worth to ``precise``
    (``"pool=1,host=0.8,disk=0.25,remote=0.25"``, any subset;
    :class:`~prefixkv.router.kv_index.TierWeights`).
    ``peer_urls``: the other router replicas, told every routing decision every
    ``peer_sync_interval`` seconds (:mod:`prefixkv.router.replicas`); ``replica_index``: this
    replica's position among them (0..N-1, e.g. a StatefulSet ordinal), so new sessions arriving
    at several replicas at once start on different workers.
    ``quarantine_ttl`` / ``quarantine_size``: how long (seconds) requests with the body of one
    that workers died serving are refused, and how many such bodies are remembered
    (:mod:`prefixkv.router.quarantine`).
    ``epp_port``: also serve the Gateway API Inference Extension's endpoint picker (Envoy
    ext_proc gRPC) on this port (0: a free one; ``None``: not at all; :mod:`prefixkv.router.epp`).
    """

    worker_urls: tuple[str, ...]
    policy: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    balance_window: int = 128
    max_tree_size: int = 2**18
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    eviction_interval: float = 60.0
    health_check_interval: float = 10.0
    health_check_timeout: float = 5.0
    failure_threshold: int = 3
    request_timeout: float = 600.0
    timeout_keep_alive: int = KEEP_ALIVE_S
    simulate_eviction: bool = False
    capacity_tokens: int | None = None
    worker_eviction_policy: str | None = None
    load_factor: float = 1.25
    hash_prefix_chunks: int = 16
    hash_replicas: int = 100
    admin_api_key: str | None = None
    seed: int | None = field(default=None)
    kv_events: tuple[str, ...] = ()
    kv_events_topic: str = ""
    kv_events_rehash: bool = False
    kv_tier_weights: str = ""
    peer_urls: tuple[str, ...] = ()
    peer_sync_interval: float = 0.01
    replica_index: int = 0
    epp_port: int | None = None
    quarantine_ttl: float = 600.0
    quarantine_size: int = 4096

    def __post_init__(self) -> None:
        urls = tuple(normalize_worker_url(u) for u in self.worker_urls)
        object.__setattr__(self, "worker_urls", urls)
        if not urls:
            raise ValueError("worker_urls must name at least one worker")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {list(POLICY_NAMES)}, got {self.policy!r}")
        if self.max_tree_size <= 0:
            raise ValueError(f"max_tree_size must be > 0, got {self.max_tree_size!r}")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 4:
            raise ValueError(f"chunk_bytes must be an int >= 4, got {self.chunk_bytes!r}")
        if self.capacity_tokens is not None and self.capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be > 0, got {self.capacity_tokens!r}")
        if self.worker_eviction_policy is not None and self.worker_eviction_policy not in POLICIES:
            raise ValueError(f"worker_eviction_policy must be one of {sorted(POLICIES)}, "
                             f"got {self.worker_eviction_policy!r}")
        if not self.load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor!r}")
        for name in ("hash_prefix_chunks", "hash_replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.kv_events:
            from prefixkv.router.kv_stream import parse_sources

            object.__setattr__(self, "kv_events", tuple(self.kv_events))
            parse_sources(urls, self.kv_events, self.kv_events_topic)  # ValueError if bad
        from prefixkv.router.kv_index import TierWeights

        TierWeights.parse(self.kv_tier_weights)  # ValueError if bad
        object.__setattr__(self, "peer_urls", tuple(normalize_worker_url(u)
                                                    for u in self.peer_urls))
        if not isinstance(self.replica_index, int) or self.replica_index < 0:
            raise ValueError(f"replica_index must be an int >= 0, got {self.replica_index!r}")
        if self.peer_sync_interval <= 0:
            raise ValueError(f"peer_sync_interval must be > 0, got {self.peer_sync_interval!r}")
        if self.epp_port is not None and not 0 <= self.epp_port <= 65535:
            raise ValueError(f"epp_port must be in [0, 65535], got {self.epp_port!r}")
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold!r}")
        if not isinstance(self.quarantine_size, int) or self.quarantine_size < 1:
            raise ValueError(f"quarantine_size must be an int >= 1, got {self.quarantine_size!r}")
        for name in ("health_check_interval", "health_check_timeout", "request_timeout",
                     "timeout_keep_alive", "quarantine_ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def max_tree_chunks(self) -> int:
        """Each tree's bound in key chunks."""
        return max(1, self.max_tree_size // self.chunk_bytes)
