"""``python -m prefixkv.bench.trace_retention TRACE``: per-session retention against the policy
alone, same run.

Every request of a retaining session (``--share`` of the sessions, 1.0: all; a session is the
requests sharing a first block id) retains its whole prefix (:class:`~prefixkv.cache.Retention`,
one TTL, renewed by the session's next request: the cache core's soft retention), replayed
through the cache core exactly as ``prefixkv bench trace`` does
(:func:`prefixkv.bench.trace.replay`), for each TTL and capacity; the first row per capacity is
the policy alone. Hit rates are given overall and for the retaining sessions and the others. The agentic trace's sessions send their next turn within seconds to minutes,
so a TTL shields a live session's context from the long contexts of the others, and lets it go
once the session has been quiet for that long.

    python -m prefixkv.bench.trace_retention data/weka_agentic/weka_agentic_a.jsonl.gz \\
        --capacity-tokens 1M 3M 10M --ttls 30 120 600 --policy experts

Prints a table of token hit rates with each TTL's ratio to the policy alone, and the gaps
between a session's consecutive requests (what a TTL has to cover).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from prefixkv.bench.trace import (
    TraceRequest,
    TraceRow,
    format_tokens,
    load_trace,
    parse_tokens,
    replay,
)
from prefixkv.cache import Retention


@dataclass(frozen=True, slots=True)
class RetentionRow:
    """One replay: the trace row, the TTL (``None``: the policy alone), and the token hit
    rates of the sessions that retain and of the others (the same sessions in every row)."""

    row: TraceRow
    ttl_s: float | None
    share: float
    retained_hit_rate: float
    others_hit_rate: float


def retains(session: int, share: float) -> bool:
    """Whether session ``session`` (its first block id) is among the ``share`` that retain
    (a fixed hash of the id, the same in every replay)."""
    return share >= 1.0 or (session * 2654435761) % 1_000_003 < share * 1_000_003


def run(requests: Sequence[TraceRequest], capacities: Sequence[int], ttls: Sequence[float],
        *, policy: str = "experts", priority: int = 50, index: str = "radix",
        block_size: int = 512, share: float = 1.0) -> list[RetentionRow]:
    """Per capacity: the policy alone, then the policy with every request of the retaining
    sessions (``share`` of them) retained for each TTL (a fresh policy and index per
    replay)."""
    chosen = [bool(r.hash_ids) and retains(r.hash_ids[0], share) for r in requests]
    mine = {id(r) for r, c in zip(requests, chosen) if c}
    out = []
    for cap in capacities:
        for ttl in (None, *ttls):
            hits: list[int] = []
            asked = None if ttl is None else Retention(priority=priority, ttl_s=ttl)

            def ask(r: TraceRequest, a: Retention | None = asked) -> Retention | None:
                return a if id(r) in mine else None

            row = replay(requests, cap, policy, index=index, block_size=block_size, hits=hits,
                         retention=None if asked is None else ask)
            row = replace(row, policy=row.policy if ttl is None else f"{policy}+retain{ttl:g}s")
            out.append(RetentionRow(row, ttl, share, _rate(requests, hits, chosen, True),
                                    _rate(requests, hits, chosen, False)))
    return out


def _rate(requests: Sequence[TraceRequest], hits: Sequence[int], chosen: Sequence[bool],
          which: bool) -> float:
    inp = sum(r.input_length for r, c in zip(requests, chosen) if c is which)
    got = sum(h for h, c in zip(hits, chosen) if c is which)
    return got / inp if inp else 0.0


def session_gaps(requests: Sequence[TraceRequest]) -> list[float]:
    """Seconds between consecutive requests of one session (a session: the requests that
    share a first block id; the agentic trace's sessions share no prefixes)."""
    last: dict[int, float] = {}
    gaps = []
    for r in requests:
        if not r.hash_ids:
            continue
        s = r.hash_ids[0]
        t = r.timestamp / 1000.0
        if s in last:
            gaps.append(t - last[s])
        last[s] = t
    return gaps


def format_table(rows: Sequence[RetentionRow]) -> str:
    """One line per capacity and variant: hit rate, its ratio to the policy alone, and the
    hit rates of the retaining sessions and of the others."""
    base = {r.row.capacity_tokens: r.row.hit_rate for r in rows if r.ttl_s is None}
    lines = [f"{'capacity':>9}  {'variant':<24}  {'hit rate':>8}  {'x alone':>7}  "
             f"{'retaining':>9}  {'others':>7}  {'req/s':>6}"]
    for r in rows:
        b = base.get(r.row.capacity_tokens) or 0.0
        ratio = f"{r.row.hit_rate / b:.3f}" if b else "-"
        lines.append(f"{format_tokens(r.row.capacity_tokens or 0):>9}  {r.row.policy:<24}  "
                     f"{r.row.hit_rate:8.4f}  {ratio:>7}  {r.retained_hit_rate:9.4f}  "
                     f"{r.others_hit_rate:7.4f}  {r.row.requests_per_s:6.0f}")
    return "\n".join(lines)


def format_gaps(gaps: Sequence[float]) -> str:
    """Percentiles of the gaps between a session's requests."""
    if not gaps:
        return "no session has two requests"
    q = statistics.quantiles(gaps, n=100)
    return (f"gaps between a session's requests: n={len(gaps)}, p50 {q[49]:.1f} s, "
            f"p90 {q[89]:.1f} s, p99 {q[98]:.1f} s, max {max(gaps):.1f} s")


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module doc)."""
    p = argparse.ArgumentParser(prog="python -m prefixkv.bench.trace_retention",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("trace", help="Mooncake-format JSONL trace (gzipped if it ends in .gz)")
    p.add_argument("--capacity-tokens", nargs="+", default=["3M"],
                   help="pool sizes in tokens (e.g. 1M 3M 10M)")
    p.add_argument("--ttls", nargs="+", type=float, default=[30.0, 120.0, 600.0],
                   help="retention TTLs in seconds, one replay each")
    p.add_argument("--policy", default="experts", help="the eviction policy under retention")
    p.add_argument("--priority", type=int, default=50, help="the retention priority (0-100)")
    p.add_argument("--share", type=float, default=1.0,
                   help="fraction of sessions that retain (by a fixed hash of the session)")
    p.add_argument("--index", default="radix", choices=("radix", "hash"))
    p.add_argument("--block-size", type=int, default=512, help="tokens per trace hash id")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    caps = [parse_tokens(c) for c in args.capacity_tokens]
    if any(c is None for c in caps):
        p.error("--capacity-tokens: give sizes (retention needs a bounded pool)")
    for ttl in args.ttls:
        Retention(priority=args.priority, ttl_s=ttl)  # ValueError naming the field
    requests = load_trace(args.trace, block_size=args.block_size)
    print(format_gaps(session_gaps(requests)), flush=True)
    if not 0 < args.share <= 1:
        p.error(f"--share must be in (0, 1], got {args.share}")
    rows = run(requests, [c for c in caps if c is not None], args.ttls, policy=args.policy,
               priority=args.priority, index=args.index, block_size=args.block_size,
               share=args.share)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
