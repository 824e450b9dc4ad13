"""Worker deaths as the router first notices them, and the request each one is pinned on.

Contract. Each attempt to send a request to a worker takes a dispatch number
(:meth:`Deaths.sent`, increasing). When an attempt is cut after its request was written
(:class:`~prefixkv.router.upstream.UpstreamError` ``cut``) or abandoned on a worker that left the
rotation (:class:`~prefixkv.router.upstream.WorkerGone`), the router asks :meth:`Deaths.judge`.
The first cut noticed on a worker opens its *death record*: how many requests were in flight
on it at that moment, the newest dispatch number then, and one ``/health`` probe that every
request this death cut waits on. The verdict for each request:

* ``None``: the worker answers its probe (one dropped connection); or the request was sent after
  the death was noticed (it cannot have caused it); or it was abandoned with no death noticed
  (the worker stopped answering its probes): a failed dispatch, retried elsewhere.
* :attr:`Verdict.STRUCK`: the worker is gone and had other requests in flight when its death
  was noticed: any of them, or nothing sent at all (a ``kill -9``, the OOM killer), may have
  killed it. The request's fingerprint gets a strike and it is retried once, as a suspect.
* :attr:`Verdict.PINNED`: the worker is gone and the request was alone on it, or it was the
  suspect held there (its second death): its fingerprint is quarantined; it is not retried.

Why one record per death. The requests one death cuts are noticed one after another: a cut on
a reused keep-alive connection is resent first and its resend fails later, and a loaded
router resumes each one later still. Judged by the in-flight count of its own moment, a late
one found the early ones already retried and looked alone, so one outside kill with two
requests in flight lost both (the router chaos test under CI load); judged by the death as
first noticed, such a kill loses none.

Lifetime. A record stays while its worker is out of the rotation (:meth:`revived` closes it
when the worker is back); a probe that finds the worker answering closes it at once. Used from
the router's event loop only.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prefixkv.router.quarantine import Quarantine

__all__ = ["Deaths", "Verdict"]


class Verdict(enum.Enum):
    """What a worker's death means for one request it cut (``None``: nothing)."""

    STRUCK = "struck"  # one of several in flight: a strike, retried once as a suspect
    PINNED = "pinned"  # the death is pinned on it: quarantined, not retried


@dataclass(slots=True)
class _Death:
    in_flight: int  # requests in flight on the worker when its death was first noticed
    last_sent: int  # the newest dispatch number then; later ones were sent after it
    gone: asyncio.Task[bool]  # the probe: True when the worker does not answer


class Deaths:
    """Death records per worker URL; verdicts go into ``quarantine`` (strike or condemn).

    ``probe(url)``: ``None`` when the worker answers ``/health``, else the reason.
    ``on_death(url, error)``: called once per confirmed death (the router takes the worker out
    of the rotation there)."""

    def __init__(self, quarantine: Quarantine, probe: Callable[[str], Awaitable[str | None]],
                 on_death: Callable[[str, str], None]) -> None:
        self.quarantine, self.probe, self.on_death = quarantine, probe, on_death
        self._sent = 0
        self._deaths: dict[str, _Death] = {}

    def sent(self) -> int:
        """A new dispatch number, for an attempt about to be sent."""
        self._sent += 1
        return self._sent

    async def judge(self, url: str, fp: str, sent: int, *, in_flight: int, error: str,
                    cut: bool) -> Verdict | None:
        """The verdict for the attempt ``sent`` (fingerprint ``fp``) that failed on ``url``:
        ``cut`` after it was written, or (not ``cut``) abandoned there. ``in_flight``: the
        worker's in-flight count now, this attempt included (it opens a record when none is)."""
        death = self._deaths.get(url)
        if death is None:
            if not cut:
                return None
            task = asyncio.ensure_future(self._confirm(url, error))
            death = self._deaths[url] = _Death(in_flight, self._sent, task)
        if not await asyncio.shield(death.gone) or sent > death.last_sent:
            return None
        if death.in_flight <= 1 or self.quarantine.held_on(url) == fp:
            self.quarantine.condemn(fp)
            return Verdict.PINNED
        self.quarantine.suspect(fp)
        return Verdict.STRUCK

    async def _confirm(self, url: str, error: str) -> bool:
        reason = await self.probe(url)
        if reason is None:  # it answers: one dropped connection, not a death
            self._deaths.pop(url, None)
            return False
        self.on_death(url, f"died serving a request ({error}); probe: {reason}")
        return True

    def revived(self, url: str) -> None:
        """``url`` is back in the rotation: its death, if any, is over."""
        self._deaths.pop(url, None)

    def close(self) -> None:
        """Cancel the probes still running (the router stops)."""
        for death in self._deaths.values():
            death.gone.cancel()
        self._deaths.clear()
