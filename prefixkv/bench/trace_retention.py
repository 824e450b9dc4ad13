"""``python -m prefixkv.bench.trace_retention TRACE``: per-session retention against the policy
alone, same run.

Every request of the trace retains its whole prefix (:class:`~prefixkv.cache.Retention`, one
TTL for every session, renewed by the session's next request: the cache core's soft
retention), replayed through the cache core exactly as ``prefixkv bench trace`` does
(:func:`prefixkv.bench.trace.replay`), for each TTL and capacity; the first row per capacity is
the policy alone. The agentic trace's sessions send their next turn within seconds to minutes,
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
from dataclasses import asdict

from prefixkv.bench.trace import (
    TraceRequest,
    TraceRow,
    format_tokens,
    load_trace,
    parse_tokens,
    replay,
)
from prefixkv.cache import Retention


def run(requests: Sequence[TraceRequest], capacities: Sequence[int], ttls: Sequence[float],
        *, policy: str = "experts", priority: int = 50, index: str = "radix",
        block_size: int = 512) -> list[TraceRow]:
    """Per capacity: the policy alone, then the policy with every request retained for each
    TTL (a fresh policy and index per replay)."""
    rows = []
    for cap in capacities:
        rows.append(replay(requests, cap, policy, index=index, block_size=block_size))
        for ttl in ttls:
            rows.append(replay(requests, cap, policy, index=index, block_size=block_size,
                               retention=Retention(priority=priority, ttl_s=ttl)))
    return rows


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


def format_table(rows: Sequence[TraceRow]) -> str:
    """One line per capacity and variant: hit rate and ratio to the policy alone."""
    base = {r.capacity_tokens: r.hit_rate for r in rows if "+retain" not in r.policy}
    lines = [f"{'capacity':>9}  {'variant':<28}  {'hit rate':>8}  {'x alone':>7}  {'req/s':>7}"]
    for r in rows:
        b = base.get(r.capacity_tokens) or 0.0
        ratio = f"{r.hit_rate / b:.3f}" if b else "-"
        lines.append(f"{format_tokens(r.capacity_tokens or 0):>9}  {r.policy:<28}  "
                     f"{r.hit_rate:8.4f}  {ratio:>7}  {r.requests_per_s:7.0f}")
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
    rows = run(requests, [c for c in caps if c is not None], args.ttls, policy=args.policy,
               priority=args.priority, index=args.index, block_size=args.block_size)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
