"""Owns: how long the server's event loop was held: ``prefixkv:event_loop_lag_seconds``.
Imports: asyncio and prometheus_client only.

Every request's bytes pass through one asyncio loop; anything a handler does without awaiting
(decoding a 10 MB body, rendering a huge chat, a slow regex) delays every other client by that
long. :class:`LoopLag` measures it from inside: a task sleeps ``interval_s`` over and over and
observes how late it woke (the time the loop was busy elsewhere) into a histogram, so an
operator sees stalls on ``/metrics`` (alert on the upper buckets) and ``prefixkv bench hostile``
reports the worst stall each hostile request caused. Cost: one wake-up per ``interval_s``
(10 ms: ~100 tiny callbacks a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry, Histogram

__all__ = ["BUCKETS", "LoopLag"]

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds; a 10 MB body's decode is ~5 ms, a stall users notice is 100 ms and up."""


class LoopLag:
    """The lag histogram of one app (in ``registry``) and the task that fills it."""

    def __init__(self, registry: CollectorRegistry, model_name: str, *,
                 interval_s: float = 0.01, clock: Callable[[], float] = time.perf_counter) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self._clock = clock
        self._hist = Histogram(
            "prefixkv:event_loop_lag_seconds", "How late the server's event loop ran a timer it "
            f"set every {interval_s * 1e3:g} ms: the time one request's work held every other "
            "request's bytes.", ["model_name"], buckets=BUCKETS, registry=registry)
        self.lag = self._hist.labels(model_name)
        self.worst_s = 0.0
        """The largest lag seen since start."""

    async def run(self) -> None:
        """Measure until cancelled."""
        while True:
            start = self._clock()
            await asyncio.sleep(self.interval_s)
            late = max(0.0, self._clock() - start - self.interval_s)
            self.lag.observe(late)
            self.worst_s = max(self.worst_s, late)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run :meth:`run` on the current loop for the ``async with`` body (an app's
        lifespan)."""
        task = asyncio.get_running_loop().create_task(self.run(), name="prefixkv-loop-lag")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
