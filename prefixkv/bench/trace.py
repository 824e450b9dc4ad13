"""Trace replay: Mooncake-format request traces through the cache core, token hit rates out.

A trace line is one request (Mooncake FAST'25 format, see ``data/mooncake/README.md``)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``hash_ids[i]`` names the ``i``-th ``block_size``-token block of the input (512 in Mooncake's
traces); an id implies its whole prefix. The replay feeds each request's ``hash_ids`` to a real
index of :mod:`prefixkv.cache` at block size 1 (one "token" per trace block), with a
:class:`~prefixkv.cache.BlockPool` of ``capacity_tokens // block_size`` blocks, exactly as an
engine does:

1. ``m = cache.match_prefix(hash_ids, lock=True)``: the leading cached blocks are a hit worth
   ``min(len(m) * block_size, input_length)`` tokens (a request's last block is usually partial);
2. ``pool.allocate(missing, evict_from=cache)``: the index evicts exactly the shortfall, the
   policy ranking every evicted block (matched blocks are locked);
3. ``cache.insert_prefix(hash_ids, ids)`` then ``cache.unlock(m)``.

All of a request's blocks get the request's time, the deeper ones first in line for eviction
(the policies' tie rule). The clock is the trace's timestamp in seconds plus ``1e-9 * index``
(arrival order breaks ties), or the request index (``clock="index"``).
"""

from __future__ import annotations

import gzip
import json
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixkv.bench.belady import BeladyPolicy
from prefixkv.cache import BlockPool, EvictionPolicy, HashPrefixCache, RadixPrefixCache, Retention
from prefixkv.cache.policies import POLICIES, make_policy
from prefixkv.cache.policy_ghost import GhostPolicy

CLOCKS = ("timestamp", "index")
INDEXES = ("hash", "radix")
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace request: arrival ``timestamp`` (ms), token counts and its block ids."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TraceRow:
    """The result of one replay (one JSON row of ``prefixkv bench trace --json``).

    ``hit_rate`` is the token hit rate: matched tokens over input tokens (a matched block is
    worth ``block_size`` tokens, except a request's last block, worth what remains of its
    input). ``block_hit_rate`` counts matched blocks over requested blocks. ``capacity_tokens``
    is ``None`` for the unbounded cache (``policy == "unbounded"``). ``requests_per_s`` is the
    replay's speed (a request = match, evict + allocate, insert, unlock) and ``policy_bytes``
    the policy's side state at the end (:func:`policy_state_bytes`). For an adaptive policy
    (one with a ``history`` of ``(clock time, expert)`` switches), ``expert_history`` is that
    history and ``expert_share`` the fraction of requests served under each expert.
    """

    policy: str
    capacity_tokens: int | None
    capacity_blocks: int | None
    hit_rate: float
    hit_tokens: int
    input_tokens: int
    block_hit_rate: float
    hit_blocks: int
    requests: int
    evicted_blocks: int
    index: str
    block_size: int
    seconds: float
    requests_per_s: float = 0.0
    policy_bytes: int = 0
    expert_history: tuple[tuple[float, str], ...] | None = None
    expert_share: dict[str, float] | None = None


def _int(obj: dict[str, object], name: str, lineno: int, *, minimum: int = 0) -> int:
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"trace line {lineno}: {name} must be an int >= {minimum}, got {v!r}")
    return v


def parse_trace(lines: Iterable[str], *, block_size: int = 512, source: str = "trace"
                ) -> list[TraceRequest]:
    """Parse and validate JSONL trace lines (blank lines are skipped).

    Raises ``ValueError`` naming the line number for: invalid JSON, a missing field, a wrong
    type, a negative value, a ``hash_ids`` length other than ``ceil(input_length /
    block_size)``, or a timestamp earlier than the previous one.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    out: list[TraceRequest] = []
    last_ts = float("-inf")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source} line {lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{source} line {lineno}: expected a JSON object")  # noqa: TRY004
        missing = [f for f in _FIELDS if f not in obj]
        if missing:
            raise ValueError(f"{source} line {lineno}: missing field(s) {', '.join(missing)}")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
            raise ValueError(f"{source} line {lineno}: timestamp must be a number >= 0, got {ts!r}")
        if ts < last_ts:
            raise ValueError(f"{source} line {lineno}: timestamp {ts} is earlier than the "
                             f"previous line's {last_ts} (requests must be in arrival order)")
        last_ts = ts
        n_in = _int(obj, "input_length", lineno, minimum=1)
        n_out = _int(obj, "output_length", lineno)
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
        ):
            raise ValueError(f"{source} line {lineno}: hash_ids must be a list of ints >= 0")
        want = -(-n_in // block_size)
        if len(ids) != want:
            raise ValueError(f"{source} line {lineno}: {len(ids)} hash_ids for input_length "
                             f"{n_in} (expected {want} blocks of {block_size} tokens)")
        out.append(TraceRequest(float(ts), n_in, n_out, tuple(ids)))
    if not out:
        raise ValueError(f"{source}: no requests")
    return out


def load_trace(path: str | Path, *, block_size: int = 512) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL file, gzipped if its name ends in ``.gz`` (see
    :func:`parse_trace` for the checks; a corrupt gzip file is a ``ValueError`` too)."""
    p = Path(path)
    if p.suffix == ".gz":
        try:
            with gzip.open(p, "rt", encoding="utf-8") as f:
                return parse_trace(f, block_size=block_size, source=str(p))
        except (OSError, EOFError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise ValueError(f"{p}: not a readable gzip file ({exc})") from None
    with p.open(encoding="utf-8") as f:
        return parse_trace(f, block_size=block_size, source=str(p))


def clock_times(requests: Sequence[TraceRequest], clock: str = "timestamp") -> list[float]:
    """The index clock's value while each request is served (strictly increasing)."""
    if clock == "timestamp":
        return [r.timestamp / 1000.0 + i * 1e-9 for i, r in enumerate(requests)]
    if clock == "index":
        return [float(i) for i in range(len(requests))]
    raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")


def online_policy_names() -> list[str]:
    """Policy names the replay accepts besides ``belady``."""
    return sorted(set(POLICIES) | {GhostPolicy.name})


def make_online_policy(name: str) -> EvictionPolicy:
    """A fresh policy object for one replay (policies keep per-index state)."""
    if name == GhostPolicy.name and name not in POLICIES:
        return GhostPolicy()
    return make_policy(name)


def replay(
    requests: Sequence[TraceRequest],
    capacity_tokens: int | None,
    policy: str | EvictionPolicy = "lru",
    *,
    block_size: int = 512,
    index: str = "hash",
    clock: str = "timestamp",
    progress: Callable[[int], None] | None = None,
    retention: Retention | Callable[[TraceRequest], Retention | None] | None = None,
    hits: list[int] | None = None,
) -> TraceRow:
    """Replay ``requests`` through a fresh index of ``capacity_tokens // block_size`` blocks.

    ``capacity_tokens=None`` means unbounded (nothing is ever evicted). ``policy`` is a policy
    name or object (``belady`` needs the future: pass
    :func:`prefixkv.bench.belady.BeladyPolicy.for_trace`). ``progress(n)`` is called with the
    number of requests done since the last call. ``retention``: every request retains its
    prefix (soft retention, renewed by the session's next request; the row's policy is then
    labelled ``<policy>+retain<ttl>s``), or a function giving each request's (or ``None``).
    ``hits``: each request's hit tokens are appended to it.
    """
    if index not in INDEXES:
        raise ValueError(f"index must be one of {INDEXES}, got {index!r}")
    if capacity_tokens is None:
        blocks = max(1, len({h for r in requests for h in r.hash_ids}))
        label, cap_blocks = "unbounded", None
    else:
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or (
            capacity_tokens < block_size
        ):
            raise ValueError(f"capacity_tokens must be an int >= block_size ({block_size}), "
                             f"got {capacity_tokens!r}")
        blocks = cap_blocks = capacity_tokens // block_size
        label = ""
    times = clock_times(requests, clock)
    if isinstance(policy, str):
        policy = (BeladyPolicy.for_trace(requests, times) if policy == BeladyPolicy.name
                  else make_online_policy(policy))
    label = label or policy.name + ("" if retention is None else "+retain" + (
        f"{retention.ttl_s:g}s" if isinstance(retention, Retention) else ""))
    now = [0.0]

    def index_clock() -> float:
        return now[0]

    cache: RadixPrefixCache | HashPrefixCache
    if index == "radix":
        cache = RadixPrefixCache(blocks, 1, eviction_policy=policy, max_pinned_blocks=0,
                                 clock=index_clock)
    else:
        # xxhash, not builtin: the same block hashes in every process, so policies that
        # sample blocks by their identity (experts) replay the same way every run
        cache = HashPrefixCache(blocks, 1, hash_algo="xxhash", eviction_policy=policy,
                                max_pinned_blocks=0, clock=index_clock)
    pool = BlockPool(blocks)
    hit_tokens = input_tokens = hit_blocks = total_blocks = 0
    chosen: Callable[[], str] | None = (
        (lambda: str(getattr(policy, "chosen")))  # noqa: B009 - not on the base class
        if hasattr(policy, "history") else None)
    served: dict[str, int] = {}
    start = time.perf_counter()
    for i, r in enumerate(requests):
        now[0] = times[i]
        ids = list(r.hash_ids)
        m = cache.match_prefix(ids, lock=True)
        k = len(m.matched_kv_blocks)
        hit_blocks += k
        total_blocks += len(ids)
        hit_tokens += min(k * block_size, r.input_length)
        input_tokens += r.input_length
        if hits is not None:
            hits.append(min(k * block_size, r.input_length))
        ret = retention(r) if callable(retention) else retention
        n = min(len(ids), blocks) - k  # a request larger than the cache keeps its head only
        new = pool.allocate(max(n, 0), evict_from=cache)  # evicts exactly the shortfall
        if new is None:
            raise RuntimeError(f"request {i}: could not allocate {n} blocks (pool accounting)")
        if n > 0:
            node = cache.insert_prefix(ids[: k + n], [*m.matched_kv_blocks, *new],
                                       retention=ret)
            if node.returned_block_ids:
                pool.free(node.returned_block_ids)
        elif ret is not None and k:
            cache.retain(ids[:k], ret)
        cache.unlock(m)
        if chosen is not None:
            name = chosen()
            served[name] = served.get(name, 0) + 1
        if progress is not None and (i + 1) % 500 == 0:
            progress(500)
    if progress is not None and len(requests) % 500:
        progress(len(requests) % 500)
    seconds = time.perf_counter() - start
    stats = cache.get_stats()
    history = getattr(policy, "history", None) if chosen is not None else None
    return TraceRow(
        policy=label,
        capacity_tokens=capacity_tokens,
        capacity_blocks=cap_blocks,
        hit_rate=hit_tokens / input_tokens,
        hit_tokens=hit_tokens,
        input_tokens=input_tokens,
        block_hit_rate=hit_blocks / total_blocks,
        hit_blocks=hit_blocks,
        requests=len(requests),
        evicted_blocks=stats.evicted_blocks,
        index=index,
        block_size=block_size,
        seconds=round(seconds, 3),
        requests_per_s=round(len(requests) / seconds, 1) if seconds > 0 else 0.0,
        policy_bytes=policy_state_bytes(policy),
        expert_history=None if history is None else tuple((float(t), str(e)) for t, e in history),
        expert_share=(None if chosen is None else
                      {k: round(v / len(requests), 4) for k, v in sorted(served.items())}),
    )


def policy_state_bytes(policy: object) -> int:
    """Bytes of a policy's side state: ``sys.getsizeof`` summed over its attributes'
    containers and their contents, not following into index entries (objects with a
    ``heap_ver`` field) or weak keys. 0 for the stateless policies (LRU, LFU, FIFO)."""
    seen: set[int] = set()
    total = 0
    stack: list[object] = list(vars(policy).values()) if hasattr(policy, "__dict__") else []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or hasattr(obj, "heap_ver") or isinstance(obj, type):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, weakref.WeakKeyDictionary):
            stack.extend(obj.values())
            total += len(obj) * 100  # the weak references and their dict slots
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__slots__") and not isinstance(obj, (int, float, str, bytes)):
            stack.extend(getattr(obj, a) for a in obj.__slots__ if hasattr(obj, a))
    return total if total > 0 and _has_state(policy) else 0


def _has_state(policy: object) -> bool:
    return any(isinstance(v, (dict, list, weakref.WeakKeyDictionary))
               for v in (vars(policy).values() if hasattr(policy, "__dict__") else ()))


def format_table(rows: Sequence[TraceRow]) -> str:
    """A readable table: one line per capacity, one column per policy (token hit rates)."""
    policies = list(dict.fromkeys(r.policy for r in rows if r.capacity_tokens is not None))
    caps = sorted({r.capacity_tokens for r in rows if r.capacity_tokens is not None})
    by = {(r.policy, r.capacity_tokens): r.hit_rate for r in rows}
    head = ["capacity (tokens)", *policies]
    lines = [head]
    for c in caps:
        lines.append([format_tokens(c), *(f"{by[(p, c)]:.4f}" if (p, c) in by else "-"
                                         for p in policies)])
    unb = [r for r in rows if r.capacity_tokens is None]
    if unb:
        lines.append(["unbounded", *([f"{unb[0].hit_rate:.4f}"] * len(policies))])
    widths = [max(len(row[j]) for row in lines) for j in range(len(head))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_ratios(rows: Sequence[TraceRow], baseline: str = "lru") -> str:
    """Each policy against ``baseline`` in the same run: hit-rate ratio per capacity, replay
    speed ratio (median over capacities), side-state memory (largest), and for an adaptive
    policy the share of requests each expert served, per capacity. ``""`` without the
    baseline."""
    base = {r.capacity_tokens: r for r in rows if r.policy == baseline}
    if not base:
        return ""
    policies = [p for p in dict.fromkeys(r.policy for r in rows if r.capacity_tokens is not None)]
    caps = sorted(c for c in base if c is not None)
    by = {(r.policy, r.capacity_tokens): r for r in rows}
    head = ["policy", *(f"x{baseline} @{format_tokens(c)}" for c in caps), "speed", "memory"]
    lines = [head]
    for p in policies:
        cells = [p]
        speeds = []
        for c in caps:
            r = by.get((p, c))
            b = base[c]
            cells.append("-" if r is None or not b.hit_rate else f"{r.hit_rate / b.hit_rate:.3f}")
            if r is not None and b.requests_per_s and r.requests_per_s:
                speeds.append(r.requests_per_s / b.requests_per_s)
        speeds.sort()
        cells.append(f"{speeds[len(speeds) // 2]:.2f}x" if speeds else "-")
        mem = max((by[(p, c)].policy_bytes for c in caps if (p, c) in by), default=0)
        cells.append(f"{mem / 1e6:.1f} MB")
        lines.append(cells)
    widths = [max(len(row[j]) for row in lines) for j in range(len(head))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if r.expert_share:
            share = ", ".join(f"{k} {v:.0%}" for k, v in r.expert_share.items())
            out.append(f"{r.policy} @{format_tokens(r.capacity_tokens or 0)}: {share} of "
                       f"requests, {len(r.expert_history or ()) - 1} switches")
    return "\n".join(out)


def format_tokens(n: int) -> str:
    """``3000000`` -> ``3M``; ``1500000`` -> ``1.5M``; ``65536`` -> ``65536``."""
    for div, suffix in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "K")):
        if n >= div and n % (div // 10) == 0:
            v = n / div
            return f"{v:g}{suffix}"
    return str(n)


def parse_tokens(text: str) -> int | None:
    """``1M`` -> 1000000, ``500K``, ``2.5M``, ``1G``, plain ints; ``unbounded``/``inf`` -> None."""
    s = str(text).strip().lower().replace("_", "")
    if s in ("unbounded", "inf", "none"):
        return None
    mult = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}.get(s[-1:], 1)
    num = s[:-1] if mult != 1 else s
    try:
        value = float(num) * mult
    except ValueError:
        raise ValueError(f"capacity must be a token count like 3M, 500K or 65536, "
                         f"got {text!r}") from None
    if value != int(value) or value <= 0:
        raise ValueError(f"capacity must be a positive whole number of tokens, got {text!r}")
    return int(value)
