"""Disturbances for router benchmarks: the workers' caches emptied behind the router's back.

:class:`PeriodicResets` empties one worker's prefix cache (``POST /v1/cache/reset``, an admin
reset) every ``every`` seconds, the workers in turn, from a thread, while a benchmark replays
its sessions. A router that guesses the caches from what it routed (``cache_aware``) keeps
sending a reset worker's sessions back to it; one that follows the workers' KV events
(``precise``) sees the ``AllBlocksCleared`` and sends them where their prefix still is.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Self

import httpx

__all__ = ["PeriodicResets"]


class PeriodicResets:
    """``with PeriodicResets(urls, every): ...``: resets until the block ends (``every <= 0``:
    none). ``resets`` counts the resets that the workers accepted."""

    def __init__(self, urls: Sequence[str], every: float,
                 headers: dict[str, str] | None = None) -> None:
        self.urls = list(urls)
        self.every = every
        self.resets = 0
        self._headers = headers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="periodic-resets", daemon=True)

    def _run(self) -> None:
        i = 0
        with httpx.Client(timeout=30.0, headers=self._headers) as client:
            while not self._stop.wait(self.every):
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
