"""Requests suspected of killing workers ("queries of death"), by body fingerprint.

Contract. A request's fingerprint is a hash of its method, path and body bytes
(:func:`fingerprint`): a client's resend, or the same request from another client, has the same
one. When a worker dies while a request is in flight on it, the router
(:mod:`prefixkv.router.deaths`, judging each request by the death as first noticed) tells
:class:`Quarantine`:

* :meth:`Quarantine.suspect` when the death is not pinned on the request (the worker had other
  requests in flight too, so any of them, or nothing sent at all, may have killed it): the
  fingerprint gets a strike that lasts ``ttl`` seconds; the request may be retried once.
* :meth:`Quarantine.condemn` when it is (the request was alone on the worker, or its fingerprint
  already has a strike from another death): requests with that fingerprint are refused
  until ``ttl`` seconds from now.

Suspects. A request whose fingerprint has a strike is sent only to a worker with no other such
request in flight (:meth:`Quarantine.without_suspects`, :meth:`Quarantine.hold` while it runs
there, :meth:`Quarantine.release`; :meth:`Quarantine.wait_for_room` when every worker holds
one), so when a worker dies with one in flight, :meth:`Quarantine.held_on` names the suspect.

Size. At most ``max_entries`` fingerprints are held (strikes and quarantines together); adding
one past that forgets the one least recently added or condemned. Time is read from ``clock``
(injectable; tests never sleep). Used from the router's event loop only (no locking).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Quarantine", "fingerprint"]


def fingerprint(method: str, path: str, body: bytes) -> str:
    """A 128-bit hex digest of ``method``, ``path`` and ``body`` (byte for byte)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{method.upper()} {path}\n".encode())
    h.update(body)
    return h.hexdigest()


@dataclass(slots=True)
class _Entry:
    until: float  # the strike or the quarantine ends then
    condemned: bool


class Quarantine:
    """Strikes and quarantines by fingerprint, each lasting ``ttl`` seconds."""

    def __init__(self, ttl: float, max_entries: int, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0, got {ttl!r}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries!r}")
        self.ttl, self.max_entries, self.clock = ttl, max_entries, clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._held: dict[str, str] = {}  # worker URL -> the suspect fingerprint in flight there
        self._room = asyncio.Event()
        self.listener: Callable[[str, float, bool], None] | None = None
        """Told ``(fp, seconds, condemned)`` of each strike and quarantine decided here (not of
        those learned from peers): router replicas pass them on (:mod:`prefixkv.router.replicas`)."""

    def __len__(self) -> int:
        return len(self._entries)

    def _live(self, fp: str) -> _Entry | None:
        entry = self._entries.get(fp)
        if entry is not None and entry.until <= self.clock():
            del self._entries[fp]
            return None
        return entry

    def refused_for(self, fp: str) -> float | None:
        """Seconds left in ``fp``'s quarantine, or ``None`` when requests with it may go."""
        entry = self._live(fp)
        if entry is None or not entry.condemned:
            return None
        return entry.until - self.clock()

    def has_strike(self, fp: str) -> bool:
        """A worker died under a request with ``fp`` within ``ttl`` (struck or condemned)."""
        return self._live(fp) is not None

    def suspect(self, fp: str) -> None:
        """A worker died with ``fp`` in flight among others: one strike (a condemned
        fingerprint stays condemned)."""
        if self.has_strike(fp):
            return
        self._put(fp, _Entry(self.clock() + self.ttl, condemned=False))
        if self.listener is not None:
            self.listener(fp, self.ttl, False)

    def condemn(self, fp: str) -> None:
        """A worker death is pinned on ``fp``: refuse it for ``ttl`` seconds from now."""
        self._entries.pop(fp, None)
        self._put(fp, _Entry(self.clock() + self.ttl, condemned=True))
        if self.listener is not None:
            self.listener(fp, self.ttl, True)

    def learn(self, fp: str, seconds: float, condemned: bool) -> None:
        """A peer replica struck (``condemned`` False) or quarantined ``fp`` for ``seconds``
        more (capped at this router's ``ttl``): the same here, not passed on again. A strike
        never lifts a quarantine; a shorter quarantine never shortens a longer one."""
        seconds = min(float(seconds), self.ttl)
        if not seconds > 0:
            return
        entry, until = self._live(fp), self.clock() + seconds
        if entry is not None and (entry.condemned and not condemned
                                  or entry.condemned == condemned and entry.until >= until):
            return
        self._entries.pop(fp, None)
        self._put(fp, _Entry(until, condemned=condemned))

    def _put(self, fp: str, entry: _Entry) -> None:
        self._entries[fp] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def without_suspects(self, urls: Sequence[str]) -> list[str]:
        """The workers in ``urls`` with no suspect request in flight."""
        return [u for u in urls if u not in self._held]

    def hold(self, url: str, fp: str) -> None:
        """A suspect request (``fp`` has a strike) is in flight on ``url``."""
        self._held[url] = fp

    def held_on(self, url: str) -> str | None:
        """The fingerprint of the suspect request in flight on ``url``, if any."""
        return self._held.get(url)

    def release(self, url: str) -> None:
        """``url``'s suspect request is over; wake those waiting for room."""
        self._held.pop(url, None)
        self._room.set()
        self._room = asyncio.Event()

    async def wait_for_room(self, timeout: float) -> None:
        """Wait until a suspect request is over, at most ``timeout`` seconds."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._room.wait(), timeout)
