"""Disturbances for router benchmarks: the workers' caches emptied behind the router's back.

:class:`PeriodicResets` empties one worker's prefix cache (``POST /v1/cache/reset``, an admin
reset) after every ``every`` dispatched requests (read from ``count``; without one, every
``every`` seconds), the workers in turn, from a thread, while a benchmark replays its sessions.
Counting requests gives two policies' runs the same resets at the same points of the replay,
however fast each runs. A router that guesses the caches from what it routed (``cache_aware``)
keeps sending a reset worker's sessions back to it; one that follows the workers' KV events
(``precise``) sees the ``AllBlocksCleared`` and sends them where their prefix still is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Self

import httpx

__all__ = ["PeriodicResets"]


class PeriodicResets:
    """``with PeriodicResets(urls, every, count): ...``: resets until the block ends
    (``every <= 0``: none). ``resets`` counts the resets that the workers accepted."""

    def __init__(self, urls: Sequence[str], every: float,
                 count: Callable[[], int] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.urls = list(urls)
        self.every = every
        self.resets = 0
        self._count = count
        self._headers = headers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="periodic-resets", daemon=True)

    def _due(self, i: int) -> bool:
        """Whether reset number ``i`` (from 0) is due."""
        return self._count is None or self._count() >= (i + 1) * self.every

    def _run(self) -> None:
        i = 0
        with httpx.Client(timeout=30.0, headers=self._headers) as client:
            while not self._stop.wait(self.every if self._count is None else 0.005):
                if not self._due(i):
                    continue
                url = self.urls[i % len(self.urls)]
                i += 1
                try:
                    if client.post(f"{url}/v1/cache/reset").status_code == 200:
                        self.resets += 1
                except httpx.HTTPError:
                    pass  # a worker that is down has nothing to reset

    def __enter__(self) -> Self:
        if self.every > 0 and self.urls:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
