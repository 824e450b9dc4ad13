"""Owns: ``prefixkv bench ...`` (trace defined here) and seed 004's ``prefixkv benchmark``.
Imports: prefixkv.bench (each benchmark module on first use).

``prefixkv bench ...``: the benchmark subcommands.

:func:`register` adds the ``bench`` parser and one subcommand per benchmark. ``trace`` is
defined here; the others live in their own modules, each exposing ``add_arguments(parser)``
and ``run_from_args(args) -> int`` (their module docstring's first line is the ``--help``
summary). A module in :data:`SUBCOMMANDS` that does not exist yet is skipped. Those modules
must keep their top-level imports light (import the engine inside ``run_from_args``) so
``prefixkv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import asdict
from typing import Any

SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("ops", "prefixkv.bench.ops"),
    ("scenarios", "prefixkv.bench.scenarios"),
    ("engine", "prefixkv.bench.engine"),
    ("route", "prefixkv.bench.route.run"),
    ("load", "prefixkv.bench.load"),
    ("stall", "prefixkv.bench.stall"),
    ("hostile", "prefixkv.bench.hostile"),
)
"""(subcommand, module) pairs added after ``trace``, in ``--help`` order."""

DEFAULT_CAPACITIES = ("1M", "3M", "10M")
DEFAULT_POLICIES = ("lru", "ghost", "experts", "belady")


def register(subparsers: Any) -> None:
    """Add ``bench`` and its subcommands to the top-level ``prefixkv`` parser."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks: trace-driven hit rates, cache ops, end-to-end scenarios",
        description="Benchmarks. See docs/benchmarks.md for every flag and the latest figures.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    add_trace(sub)
    for name, module_name in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a benchmark not written yet
            if exc.name != module_name:
                raise
            continue
        doc = (module.__doc__ or name).strip()
        summary = doc.splitlines()[0].replace("``", "")
        summary = summary.split(": ", 1)[1] if summary.startswith("prefixkv ") else summary
        p = sub.add_parser(name, help=summary.rstrip("."), description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run_from_args)
    _register_benchmark(subparsers)


def _register_benchmark(sub: Any) -> None:
    """Add ``prefixkv benchmark`` (seed 004's name) to the top-level parser."""
    from prefixkv.bench import compare

    p = sub.add_parser("benchmark", help="TTFT and prefill tokens with vs without prefix caching",
                       description=compare.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--with-prefix-cache", action="store_true", help="run the cached engine")
    p.add_argument("--without-prefix-cache", action="store_true", help="run the uncached engine")
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--requests", type=int, default=8, help="prompts (default 8)")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared prefix tokens (default 1024)")
    p.add_argument("--suffix-len", type=int, default=32, help="per-prompt tokens (default 32)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=compare.run_from_args)


def add_trace(sub: Any) -> None:
    """Add ``prefixkv bench trace FILE``."""
    from prefixkv.bench.trace import CLOCKS, INDEXES

    p = sub.add_parser(
        "trace", help="replay a Mooncake-format trace through the cache core: hit rate vs capacity",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Replay a Mooncake-format JSONL trace (timestamp, input_length, output_length,\n"
            "hash_ids: one id per --block-size tokens) through the cache core (a real index and\n"
            "block pool) for every policy and capacity, plus an unbounded cache. Prints a table\n"
            "of token hit rates; --json writes the rows, --plot a PNG of hit rate vs capacity\n"
            "(like Mooncake FAST'25 Fig. 9). See docs/benchmarks.md."),
        epilog=("example:\n  prefixkv bench trace data/mooncake/mooncake_conversation_trace.jsonl \\\n"
                "      --capacity-tokens 1M 3M 10M --policies lru ghost belady --plot hit.png"))
    p.add_argument("file", metavar="FILE",
                   help="trace file (JSON lines, Mooncake format; gzipped if it ends in .gz)")
    p.add_argument("--capacity-tokens", nargs="+", default=list(DEFAULT_CAPACITIES),
                   metavar="N", help="cache capacities in tokens: 3M, 500K, 2.5M, 65536 ... "
                   f"(K/M/G are powers of 1000; default: {' '.join(DEFAULT_CAPACITIES)}); "
                   "each becomes N // block-size blocks")
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), metavar="NAME",
                   help="eviction policies: any of the cache's policies (lru, lfu, fifo, ghost, experts, "
                   "...) and belady, the offline optimum (default: "
                   f"{' '.join(DEFAULT_POLICIES)})")
    p.add_argument("--block-size", type=int, default=512, metavar="TOKENS",
                   help="tokens per trace hash id (default 512, Mooncake's)")
    p.add_argument("--index", choices=INDEXES, default="hash",
                   help="which index replays the trace, at block size 1 over hash ids "
                   "(default hash: one entry per block, xxhash, hits verified; "
                   "radix is faster)")
    p.add_argument("--clock", choices=CLOCKS, default="timestamp",
                   help="the index clock: trace timestamp in seconds (ties broken by arrival "
                   "order; default) or the request index")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="replay only the first N requests")
    p.add_argument("--no-unbounded", action="store_true",
                   help="skip the unbounded-cache row")
    p.add_argument("--json", metavar="PATH", help="write the result rows as a JSON list")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of hit rate vs capacity")
    p.add_argument("--experts-plot", metavar="PATH",
                   help="write a PNG of the expert an adaptive policy (experts) chose over time, "
                   "one panel per capacity")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    t = p.add_argument_group("tiers (instead of the policy grid: LRU pool + LRU tiers below it)")
    t.add_argument("--tiers", nargs="+", metavar="N", default=None,
                   help="tokens of pool then of each tier below it, e.g. 3M 30M [300M]; "
                   "reports hit rate per tier and the prefill time saved")
    t.add_argument("--tier-bandwidth-gbps", nargs="+", type=float, default=[], metavar="GBPS",
                   help="load bandwidth of each tier below the pool (default 25 3 1: host, "
                   "disk, remote)")
    t.add_argument("--prefill-tokens-per-s", type=float, default=4000.0,
                   help="cost model: prefill speed (default 4000)")
    t.add_argument("--kv-bytes-per-token", type=int, default=524288,
                   help="cost model: KV bytes per token (default 524288: a 7B model in fp16)")
    p.set_defaults(func=run_trace)


def run_trace(args: argparse.Namespace) -> int:
    """Handler of ``prefixkv bench trace``: validate every flag first, then replay."""
    from prefixkv.bench.trace import (
        clock_times,
        format_ratios,
        format_table,
        load_trace,
        online_policy_names,
        parse_tokens,
        replay,
    )

    if args.block_size <= 0:
        raise ValueError(f"--block-size must be a positive int, got {args.block_size}")
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit must be a positive int, got {args.limit}")
    caps: list[int] = []
    for text in args.capacity_tokens:
        c = parse_tokens(text)
        if c is None:
            continue  # "unbounded" is always added unless --no-unbounded
        if c < args.block_size:
            raise ValueError(f"--capacity-tokens {text} is smaller than one block "
                             f"({args.block_size} tokens)")
        caps.append(c)
    caps = sorted(set(caps))
    if args.plot and not caps:
        raise ValueError("--plot needs at least one finite --capacity-tokens value")
    if args.experts_plot and not (caps and "experts" in [p.lower() for p in args.policies]):
        raise ValueError("--experts-plot needs --policies experts and a finite --capacity-tokens")
    known = online_policy_names() + ["belady"]
    policies = list(dict.fromkeys(p.lower() for p in args.policies))
    bad = [p for p in policies if p not in known]
    if bad:
        raise ValueError(f"--policies: unknown {', '.join(bad)} (choose from {', '.join(known)})")
    requests = load_trace(args.file, block_size=args.block_size)
    if args.limit is not None:
        requests = requests[: args.limit]
    if args.tiers is not None:
        return _run_tiers(args, requests)
    runs: list[tuple[str, int | None]] = [(p, c) for p in policies for c in caps]
    if not args.no_unbounded:
        runs.append(("lru", None))
    bar = _progress(len(runs) * len(requests), disable=args.no_progress)
    rows = []
    try:
        for policy, cap in runs:
            bar.set_description(f"{policy} @ {cap or 'unbounded'}")
            rows.append(replay(requests, cap, policy, block_size=args.block_size,
                               index=args.index, clock=args.clock, progress=bar.update))
    finally:
        bar.close()
    print(f"{args.file}: {len(requests)} requests, "
          f"{sum(r.input_length for r in requests):,} input tokens, index={args.index}, "
          f"block size {args.block_size}, clock={args.clock}")
    print(format_table(rows))
    ratios = format_ratios(rows)
    if ratios:
        print(f"\nagainst lru in this run (speed: replayed requests/s, median over capacities; "
              f"memory: policy side state):\n{ratios}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    if args.plot and caps:
        from prefixkv.bench.plots import plot_hit_rates

        plot_hit_rates(rows, args.plot, title=f"{_basename(args.file)}: token hit rate "
                                               f"(block {args.block_size}, {args.index} index)")
        print(f"wrote {args.plot}")
    if args.experts_plot:
        from prefixkv.bench.plots import plot_expert_history

        times = clock_times(requests, args.clock)
        plot_expert_history(rows, args.experts_plot, end_time=times[-1], request_times=times,
                            xlabel="requests served (arrival order)",
                            title=f"{_basename(args.file)}: expert chosen over time "
                                  f"(block {args.block_size}, {args.index} index)")
        print(f"wrote {args.experts_plot}")
    return 0


def _basename(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def _progress(total: int, *, disable: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="req", disable=disable or not sys.stderr.isatty(),
                leave=False, dynamic_ncols=True)


def _run_tiers(args: argparse.Namespace, requests: list[Any]) -> int:
    """``prefixkv bench trace FILE --tiers POOL TIER...``."""
    from prefixkv.bench.trace import parse_tokens, replay
    from prefixkv.bench.trace_tiers import format_tier_row, replay_tiered

    caps = [parse_tokens(t) for t in args.tiers]
    if any(c is None for c in caps):
        raise ValueError(f"--tiers takes finite capacities, got {args.tiers}")
    row = replay_tiered(requests, [c for c in caps if c is not None],
                        block_size=args.block_size, bandwidths_gbps=args.tier_bandwidth_gbps,
                        prefill_tokens_per_s=args.prefill_tokens_per_s,
                        kv_bytes_per_token=args.kv_bytes_per_token, clock=args.clock)
    unbounded = None if args.no_unbounded else replay(
        requests, None, "lru", block_size=args.block_size, index=args.index,
        clock=args.clock).hit_rate
    print(f"{args.file}: {len(requests)} requests, {row.input_tokens:,} input tokens, "
          f"block size {args.block_size}, LRU in every tier")
    print(format_tier_row(row, unbounded))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**asdict(row), "unbounded_hit_rate": unbounded}, f, indent=1)
    return 0
