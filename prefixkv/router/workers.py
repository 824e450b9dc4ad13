"""The worker registry: each worker's load counters and its circuit breaker.

A worker is any OpenAI-compatible server (prefixkv, vLLM, SGLang) reachable at a base URL that
answers ``GET /health`` with a 2xx. The registry is the router's only record of workers; it is
used from the router's event loop only (no locking).

Circuit breaker, per worker (``Worker.state``):

* ``closed``: in rotation. A failed dispatch (the connection failed or dropped, or a 5xx the
  worker did not blame on the request) adds one to ``consecutive_failures``; at
  ``failure_threshold`` in a row the breaker opens. A successful answer resets the count. The
  router also probes ``/health`` at once after any failure, and a failed probe opens the breaker
  (a killed worker leaves the rotation within one probe; one dropped connection does not).
* ``open``: out of rotation; the health loop probes it every interval.
* ``half_open``: a probe answered again: back in rotation on trial. Its first successful answer
  closes the breaker, its first failure opens it again. Only a probe *sent after* the last
  failure counts: an answer to a probe sent before a worker died (read late, after its requests
  failed and it left the rotation) would otherwise bring a dead worker back.

Opening or closing never touches what the policy believes the worker has cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

__all__ = ["Worker", "WorkerRegistry", "normalize_worker_url"]

BreakerState = Literal["closed", "open", "half_open"]


def normalize_worker_url(url: str) -> str:
    """``http(s)://host[:port][/path]`` without a trailing slash; ``ValueError`` otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"bad worker URL {url!r}: expected http://HOST:PORT or https://HOST:PORT")
    try:
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise ValueError(f"bad worker URL {url!r}: {exc}") from None
    if parts.query or parts.fragment:
        raise ValueError(f"bad worker URL {url!r}: no query or fragment allowed")
    return url.strip().rstrip("/")


@dataclass(slots=True)
class Worker:
    """One worker's state as the router sees it.

    ``in_flight`` counts requests dispatched and not yet finished (the load the policies use);
    ``routed`` counts dispatches; ``failures`` counts failed dispatches and failed probes;
    ``consecutive_failures`` the dispatch failures since the last success (the breaker's count).
    """

    url: str
    state: BreakerState = "closed"
    in_flight: int = 0
    routed: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None
    last_failure_at: float = float("-inf")
    """When the last failed dispatch or probe was recorded (the registry's clock)."""

    @property
    def healthy(self) -> bool:
        """In rotation (breaker closed or half open)."""
        return self.state != "open"


class WorkerRegistry:
    """The workers, in the order given; URLs are normalized and must be distinct."""

    def __init__(self, urls: Iterable[str], *, failure_threshold: int = 3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        normalized = [normalize_worker_url(u) for u in urls]
        if not normalized:
            raise ValueError("worker_urls must name at least one worker")
        if len(set(normalized)) != len(normalized):
            raise ValueError(f"worker_urls has duplicates: {normalized}")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold!r}")
        self.failure_threshold = failure_threshold
        self.clock = clock
        """The time source of ``last_failure_at`` and of probe start times (:meth:`mark_up`)."""
        self._workers = {u: Worker(u) for u in normalized}

    @property
    def urls(self) -> list[str]:
        """All worker URLs, healthy or not."""
        return list(self._workers)

    def __getitem__(self, url: str) -> Worker:
        return self._workers[url]

    def all(self) -> list[Worker]:
        """Every worker record (live objects)."""
        return list(self._workers.values())

    def healthy(self, exclude: Iterable[str] = ()) -> list[str]:
        """URLs of workers in rotation not in ``exclude``, in registry order."""
        skip = set(exclude)
        return [u for u, w in self._workers.items() if w.healthy and u not in skip]

    def loads(self) -> dict[str, int]:
        """In-flight requests per worker."""
        return {u: w.in_flight for u, w in self._workers.items()}

    def begin(self, url: str) -> None:
        """A request was dispatched to ``url``."""
        w = self._workers[url]
        w.in_flight += 1
        w.routed += 1

    def end(self, url: str) -> None:
        """A request dispatched to ``url`` finished (successfully or not)."""
        self._workers[url].in_flight -= 1

    def record_success(self, url: str) -> None:
        """``url`` answered a request: the failure count restarts; a half-open breaker closes."""
        w = self._workers[url]
        w.consecutive_failures = 0
        if w.state == "half_open":
            w.state = "closed"

    def record_failure(self, url: str, error: str) -> bool:
        """A dispatch to ``url`` failed; True if that opened its breaker (it left the rotation)."""
        w = self._workers[url]
        w.failures += 1
        w.consecutive_failures += 1
        w.last_error = error
        w.last_failure_at = self.clock()
        if w.state == "half_open" or (
            w.state == "closed" and w.consecutive_failures >= self.failure_threshold
        ):
            w.state = "open"
            return True
        return False

    def mark_down(self, url: str, error: str) -> bool:
        """A probe of ``url`` failed: open its breaker; True if it was in rotation until now."""
        w = self._workers[url]
        w.failures += 1
        w.last_error = error
        w.last_failure_at = self.clock()
        was = w.healthy
        w.state = "open"
        return was

    def mark_up(self, url: str, sent_at: float | None = None) -> bool:
        """A probe of ``url`` answered: an open breaker goes half open; True if it re-entered.

        ``sent_at`` (the registry's clock when the probe was sent): an answer to a probe sent
        before the last recorded failure is stale and changes nothing."""
        w = self._workers[url]
        if w.state != "open" or (sent_at is not None and sent_at < w.last_failure_at):
            return False
        w.state = "half_open"
        w.consecutive_failures = 0
        return True
