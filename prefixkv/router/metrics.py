"""The router's Prometheus metrics (``GET /metrics``), in a registry of its own per router.

Names carry a ``prefixkv:router_`` prefix. Per worker: requests routed (by decision reason),
the estimated match ratio of each routed request, failures (by kind), requests in flight,
health, and the approximate tree size; for ``precise``, the KV event batches applied and those
that could not be read; plus retries, requests that found no worker, worker deaths pinned on a
request and the requests refused for it (quarantined).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from prefixkv.router.workers import WorkerRegistry

__all__ = ["CONTENT_TYPE", "RouterMetrics"]

_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


class RouterMetrics:
    """Counters updated by the proxy; gauges refreshed from the registry at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "prefixkv:router_requests", "Requests dispatched to a worker (retries included).",
            ["worker", "reason"], registry=r,
        )
        self.match_ratio = Histogram(
            "prefixkv:router_match_ratio",
            "Estimated cached share of each dispatched prompt on its worker (cache_aware only).",
            ["worker"], buckets=_RATIO_BUCKETS, registry=r,
        )
        self.failures = Counter(
            "prefixkv:router_failures",
            "Failed dispatches and probes: kind is connect, status_5xx, abandoned, stream, probe or "
            "died (the worker died with the request in flight).",
            ["worker", "kind"], registry=r,
        )
        self.retries = Counter(
            "prefixkv:router_retries", "Requests sent again to another worker after a failure.",
            registry=r,
        )
        self.unroutable = Counter(
            "prefixkv:router_no_worker", "Requests answered 503 because no worker was healthy.",
            registry=r,
        )
        self.quarantined = Counter(
            "prefixkv:router_quarantined_requests",
            "Requests refused (503 request_quarantined) or not retried because workers died "
            "serving requests with the same body.", registry=r,
        )
        self.request_deaths = Counter(
            "prefixkv:router_request_caused_deaths",
            "Worker deaths pinned on the request in flight (its body was then quarantined).",
            ["worker"], registry=r,
        )
        self.in_flight = Gauge(
            "prefixkv:router_in_flight", "Requests in flight per worker.", ["worker"], registry=r
        )
        self.healthy = Gauge(
            "prefixkv:router_worker_healthy", "1 if the worker is in rotation.", ["worker"],
            registry=r,
        )
        self.tree_size = Gauge(
            "prefixkv:router_tree_size",
            "Key chunks in the worker's approximate prefix tree (cache_aware only).",
            ["worker"], registry=r,
        )

        self.event_batches = Gauge(
            "prefixkv:router_kv_event_batches",
            "KV event batches from the worker applied to the exact index (precise only).",
            ["worker"], registry=r,
        )
        self.event_undecodable = Gauge(
            "prefixkv:router_kv_event_undecodable",
            "KV event batches from the worker that could not be decoded (precise only).",
            ["worker"], registry=r,
        )

    def observe_dispatch(self, url: str, reason: str, match_ratio: float | None) -> None:
        """One request sent to ``url`` (``match_ratio`` is None for policies without trees)."""
        self.requests.labels(url, reason).inc()
        if match_ratio is not None:
            self.match_ratio.labels(url).observe(match_ratio)

    def observe_failure(self, url: str, kind: str) -> None:
        """A dispatch or probe to ``url`` failed."""
        self.failures.labels(url, kind).inc()

    def render(self, workers: WorkerRegistry, policy_state: dict[str, dict[str, int]]) -> bytes:
        """The text exposition, with gauges taken from ``workers`` and the policy's
        ``describe()`` now."""
        for w in workers.all():
            self.in_flight.labels(w.url).set(w.in_flight)
            self.healthy.labels(w.url).set(1 if w.healthy else 0)
        for url, state in policy_state.items():
            if "tree_size" in state:
                self.tree_size.labels(url).set(state["tree_size"])
            if "event_batches" in state:
                self.event_batches.labels(url).set(state["event_batches"])
                self.event_undecodable.labels(url).set(state["event_undecodable"])
        return generate_latest(self.registry)
