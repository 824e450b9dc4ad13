"""Router replicas that share what they learn: N ``prefixkv route`` processes behind any load
balancer route as one.

Each ``cache_aware`` router (and the ``cache_aware`` tree inside ``precise``) learns which worker
holds which prefix only from the requests *it* routed; behind a round-robin balancer, each of N
replicas sees 1/N of every session, and a session's next turn, arriving at another replica, goes
wherever that replica's partial view says. Replicas started with ``--peer-urls`` (the other
replicas' base URLs) tell each other every routing decision: :class:`ReplicaSync` collects
``(worker, route key)`` pairs as the policy records them and, every ``interval`` seconds, posts the
batch to each peer's ``POST /router/learn``; a replica receiving one inserts the keys into its own
tree of that worker (:meth:`CacheAwarePolicy.learn`: the tree only, not its load or dispatch
window, which stay each replica's own view). Keys are the router's chunk hashes (no prompt text
crosses the wire); a worker a replica does not know is skipped.

Why peer-to-peer HTTP and not the shared Valkey: the tiers' Valkey is optional, a decision must
reach the peers before the session's next turn (tens of milliseconds, not a poll), and the
replicas already speak HTTP; N replicas send ``N - 1`` small posts per interval each. A peer
that is down misses what was sent meanwhile (it learns again from its own traffic); the posts
are best effort and never delay a request. ``precise`` replicas need none of this for their
exact index (each subscribes to every worker's events); the sync keeps their fallback trees
in step too.

Replicas also share their quarantine (:mod:`prefixkv.router.quarantine`): a strike or a
quarantine decided by one (a worker died under a request) goes with the next post as ``(body
fingerprint, seconds left, condemned)``, so a query of death that killed a worker through one
replica is refused by every replica instead of killing one worker per replica. Every router
started with ``--peer-urls`` shares its quarantine, whatever its policy.

``POST /router/learn`` follows the router's admin rule (the admin key when one is set, else
loopback clients only): a stranger cannot steer the trees.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import httpx
import orjson

from prefixkv.router.keys import RouteKey

if TYPE_CHECKING:
    from prefixkv.router.cache_aware import CacheAwarePolicy

__all__ = ["MAX_BATCH", "Learned", "PeerLoads", "QuarantineNote", "ReplicaSync", "decode_learn",
           "encode_entries", "learning_policy"]

log = logging.getLogger("prefixkv.router")

MAX_BATCH = 4096
"""Decisions kept for the next post at most; older ones are dropped first (a burst bigger than
this between two flushes is learned partly, and the peers' own traffic fills the rest)."""


def learning_policy(policy: object) -> CacheAwarePolicy | None:
    """The :class:`CacheAwarePolicy` inside a router's policy (itself, or ``precise``'s fallback);
    ``None`` for policies that keep no trees (round robin, random, least load, consistent hash)."""
    from prefixkv.router.cache_aware import CacheAwarePolicy

    if isinstance(policy, CacheAwarePolicy):
        return policy
    fallback = getattr(policy, "fallback", None)
    return fallback if isinstance(fallback, CacheAwarePolicy) else None


def _plain(value: Hashable) -> Any:
    """A namespace as JSON: tuples become lists (recursively)."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _hashable(value: Any) -> Hashable:
    """The inverse of :func:`_plain`: lists back to tuples; other JSON values as they are."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        raise ValueError("a route key namespace cannot hold an object")
    return value  # type: ignore[no-any-return]


QuarantineNote = tuple[str, float, bool]
"""A strike or quarantine passed between replicas: ``(body fingerprint, seconds, condemned)``."""


class Learned(NamedTuple):
    """A parsed ``POST /router/learn`` body."""

    replica: str
    loads: dict[str, int]
    entries: list[tuple[str, RouteKey]]
    quarantine: list[QuarantineNote]


def encode_entries(entries: Sequence[tuple[str, RouteKey]], *, replica: str = "",
                   loads: Mapping[str, int] | None = None,
                   quarantine: Sequence[QuarantineNote] = ()) -> bytes:
    """The body of ``POST /router/learn``: ``{"replica": id, "loads": {worker: in flight},
    "entries": [[worker, namespace, chunks, size, unit], ...], "quarantine": [[fingerprint,
    seconds, condemned], ...]}``."""
    return orjson.dumps({"replica": replica, "loads": dict(loads or {}),
                         "entries": [[url, _plain(k.namespace), list(k.chunks), k.size, k.unit]
                                     for url, k in entries],
                         "quarantine": [list(q) for q in quarantine]})


def _quarantine_notes(rows: object) -> list[QuarantineNote]:
    if rows is None:  # from a replica of an older release
        return []
    if not isinstance(rows, list) or len(rows) > MAX_BATCH:
        raise ValueError(f"quarantine must be a list of at most {MAX_BATCH} entries")
    out: list[QuarantineNote] = []
    for i, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)
                and 0 < len(row[0]) <= 64 and isinstance(row[1], (int, float))
                and not isinstance(row[1], bool) and isinstance(row[2], bool)):
            raise ValueError(f"quarantine[{i}] must be [fingerprint, seconds, condemned]")
        out.append((row[0], float(row[1]), row[2]))
    return out


def decode_learn(body: bytes) -> Learned:
    """Parse a learn body once: the sender's id, its in-flight loads, the entries and the
    quarantine notes (``ValueError`` naming what is wrong)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"body is not valid JSON: {exc}") from None
    rows = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError("entries must be a list")
    out: list[tuple[str, RouteKey]] = []
    for i, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str)
                and isinstance(row[2], list) and isinstance(row[3], int)
                and isinstance(row[4], int)):
            raise ValueError(f"entries[{i}] must be [worker, namespace, chunks, size, unit]")
        chunks = row[2]
        if not all(isinstance(c, int) and 0 <= c < 2**32 for c in chunks):
            raise ValueError(f"entries[{i}]: chunks must be ints in [0, 2**32)")
        out.append((row[0], RouteKey(_hashable(row[1]), tuple(chunks), row[3], max(1, row[4]))))
    replica, loads = data.get("replica"), data.get("loads")
    if not isinstance(replica, str) or not isinstance(loads, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in loads.items()):
        raise ValueError("replica must be a string and loads an object of counts")
    return Learned(replica, loads, out, _quarantine_notes(data.get("quarantine")))


class PeerLoads:
    """The requests each peer replica has in flight at each worker, as it last said; a peer
    silent for ``ttl`` seconds (down, or partitioned) counts as nothing. Owned by the policy
    that adds them to its own loads (:meth:`add`)."""

    def __init__(self, ttl: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._by_peer: dict[str, tuple[float, dict[str, int]]] = {}

    def update(self, peer: str, loads: Mapping[str, int]) -> None:
        """``peer`` has ``loads`` in flight now."""
        self._by_peer[peer] = (self._clock(), dict(loads))

    def add(self, loads: Mapping[str, int], urls: Sequence[str]) -> dict[str, int]:
        """``loads`` (this router's) plus every live peer's, for each of ``urls``."""
        now = self._clock()
        total = {u: loads.get(u, 0) for u in urls}
        for seen, theirs in self._by_peer.values():
            if now - seen <= self.ttl:
                for u in urls:
                    total[u] += theirs.get(u, 0)
        return total


class ReplicaSync:
    """Sends this replica's routing decisions and its in-flight loads to its peers; owns the
    pending batch and the flush task. Used from the router's event loop only. A post goes out
    when decisions are pending or ``loads()`` changed since the last one.

    :meth:`note` is the policy's listener (called as each decision is recorded); :meth:`start`
    begins flushing every ``interval`` seconds on ``client``; :meth:`stop` flushes once more and
    ends the task. ``headers`` go with every post (the admin key, when the fleet has one).
    """

    def __init__(self, peer_urls: Sequence[str], *, interval: float = 0.01,
                 headers: dict[str, str] | None = None, timeout: float = 2.0,
                 loads: Callable[[], Mapping[str, int]] = dict) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval!r}")
        self.replica = uuid.uuid4().hex
        self._loads = loads
        self._last_loads: dict[str, int] = {}
        self.peer_urls = tuple(u.rstrip("/") for u in peer_urls)
        self.interval = interval
        self.headers = {"content-type": "application/json", **(headers or {})}
        self.timeout = timeout
        self._pending: list[tuple[str, RouteKey]] = []
        self._quarantine: list[QuarantineNote] = []
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None
        self.sent = 0  # decisions posted (to every peer)
        self.dropped = 0  # decisions dropped: batch overflow
        self.failed_posts = 0  # posts a peer did not take (down, refused)

    def note(self, url: str, key: RouteKey) -> None:
        """``key`` was routed to ``url`` here: queue it for the peers (keys with no chunks, which
        teach nothing, are skipped)."""
        if not key.chunks:
            return
        self._pending.append((url, key))
        if len(self._pending) > MAX_BATCH:
            extra = len(self._pending) - MAX_BATCH
            del self._pending[:extra]
            self.dropped += extra

    def note_quarantine(self, fp: str, seconds: float, condemned: bool) -> None:
        """This router struck or quarantined ``fp`` (:attr:`Quarantine.listener`): queue it for
        the peers."""
        self._quarantine.append((fp, seconds, condemned))
        del self._quarantine[:-MAX_BATCH]

    async def flush(self) -> None:
        """Post what is pending to every peer now (concurrently; failures counted, logged once
        per peer and flush)."""
        loads = dict(self._loads())
        if (not self._pending and not self._quarantine and loads == self._last_loads) \
                or self._client is None or not self.peer_urls:
            return
        batch, self._pending, self._last_loads = self._pending, [], loads
        notes, self._quarantine = self._quarantine, []
        body = encode_entries(batch, replica=self.replica, loads=loads, quarantine=notes)
        client = self._client

        async def post(peer: str) -> None:
            try:
                resp = await client.post(f"{peer}/router/learn", content=body,
                                         headers=self.headers, timeout=self.timeout)
                if resp.status_code != 200:
                    self.failed_posts += 1
                    log.warning("replica %s refused what this router learned: %s %s", peer,
                                resp.status_code, resp.text[:200])
            except httpx.HTTPError as exc:
                self.failed_posts += 1
                log.debug("replica %s unreachable: %r", peer, exc)

        await asyncio.gather(*(post(p) for p in self.peer_urls))
        self.sent += len(batch)

    async def start(self, client: httpx.AsyncClient) -> None:
        """Start flushing on ``client`` (the router's own)."""
        self._client = client
        self._task = asyncio.create_task(self._run(), name="prefixkv-replica-sync")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.flush()
            except Exception:  # never let the sync end: the next interval tries again
                log.exception("replica sync failed")

    async def stop(self) -> None:
        """Flush once more, then end the task."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self.flush()
