"""``prefixkv bench ops``: microbenchmarks of the cache core (issue 2's workload).

Workload: 1,000 cached distinct 1,024-token prompts plus a 2,000-token system prompt; match a
2,048-token prompt sharing the system prompt; insert a 1,024-token sequence sharing 512 tokens
with a cached prompt; evict 10 blocks from a full cache; memory of 1,000 cached 512-token
prefixes (tracemalloc). Token ids are fresh Python ints in [0, 150000), as a tokenizer returns
them (so equal tokens are equal values, not the same objects).

Every figure is a median over many calls, and is also given as a ratio against seed 004's
reference radix tree (:mod:`prefixkv.bench.ops_baseline`) measured in the same run.
"""

from __future__ import annotations

import gc
import json
from array import array
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from prefixkv.bench.ops_baseline import SeedReferenceRadix
from prefixkv.cache import BlockPool, HashPrefixCache, RadixPrefixCache

VOCAB = 150_000


@dataclass(slots=True)
class OpsRow:
    """One index's medians (microseconds) and memory (bytes per cached prefix)."""

    index: str
    match_us: float
    insert_us: float
    evict10_us: float
    bytes_per_prefix: float


def _fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _copy(tokens: list[int]) -> list[int]:
    """Same values, new int objects (defeats CPython's identity shortcut in comparisons)."""
    return [int(str(t)) for t in tokens]


def _median_us(fn: Callable[[int], Any], n: int) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn(i)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000


def _workload(seed: int, n_prompts: int) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        "system": _fresh(rng, 2000),
        "prompts": [_fresh(rng, 1024) for _ in range(n_prompts)],
        "suffixes": [_fresh(rng, 512) for _ in range(400)],
        "query_tail": _fresh(rng, 48),
        "mem_prefixes": [_fresh(rng, 512) for _ in range(1000)],
    }


def _parse(kind: str) -> tuple[str, int, bool]:
    """``radix-bs16+array`` -> (``radix``, 16, True): the index, block size, array input."""
    if kind == "seed-reference":
        return kind, 1, False
    body, plus, mode = kind.partition("+")
    if plus and mode != "array":
        raise ValueError(f"unknown input mode in {kind!r} (only +array)")
    name, sep, bs = body.rpartition("-bs")
    if not sep or not bs.isdigit():
        raise ValueError(f"bad kind {kind!r}: expected INDEX-bsN[+array], e.g. radix-bs16")
    return name, int(bs), bool(plus)


def _make(kind: str, capacity: int) -> Any:
    name, bs, _ = _parse(kind)
    if name == "seed-reference":
        return SeedReferenceRadix()
    if name.startswith("hash"):
        algo = name.split(":")[1] if ":" in name else "sha256"
        return HashPrefixCache(capacity, bs, hash_algo=algo)
    if name != "radix":
        raise ValueError(f"unknown index in kind {kind!r}")
    return RadixPrefixCache(capacity, bs)


def _insert(cache: Any, pool: BlockPool | None, tokens: list[int], bs: int) -> None:
    if pool is None:
        cache.insert_prefix(tokens, list(range(len(tokens))))
        return
    m = cache.match_prefix(tokens)
    ids = pool.allocate(len(tokens) // bs - len(m.matched_kv_blocks), evict_from=cache)
    assert ids is not None
    node = cache.insert_prefix(tokens, m.matched_kv_blocks + ids)
    pool.free(node.returned_block_ids)


def bench_index(kind: str, w: dict[str, Any], iters: int) -> OpsRow:
    """Measure one index kind on the shared workload."""
    _, bs, as_array = _parse(kind)
    conv: Callable[[list[int]], Any] = (lambda t: array("I", t)) if as_array else (lambda t: t)
    total = (2000 + 1024 * len(w["prompts"]) + 512 * len(w["suffixes"])) // bs + 64
    cache = _make(kind, total)
    pool = None if kind == "seed-reference" else BlockPool(total)
    system = w["system"]
    _insert(cache, pool, system, bs)
    for p in w["prompts"]:
        _insert(cache, pool, p, bs)
    query = conv(_copy(system + w["query_tail"]))
    match_us = _median_us(lambda i: cache.match_prefix(query), iters)

    base = [_copy(p[:512]) for p in w["prompts"]]
    seqs = [conv(base[i % len(base)] + w["suffixes"][i]) for i in range(len(w["suffixes"]))]
    if pool is None:
        insert_us = _median_us(lambda i: cache.insert_prefix(seqs[i], list(range(1024))), len(seqs))
    else:
        id_lists = [pool.allocate(512 // bs) for _ in seqs]
        cached = [cache.match_prefix(s[:512]).matched_kv_blocks for s in seqs]

        def ins(i: int) -> None:
            cache.insert_prefix(seqs[i], cached[i] + id_lists[i])

        insert_us = _median_us(ins, len(seqs))

    evict_us = _median_us(lambda i: cache.evict_lru(10), min(iters, 200))
    return OpsRow(kind, match_us, insert_us, evict_us,
                  _memory(kind, [conv(p) for p in w["mem_prefixes"]]))


def _memory(kind: str, prefixes: list[Any]) -> float:
    _, bs, _ = _parse(kind)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = _make(kind, 1000 * 512 // bs + 8)
    next_id = 0
    for p in prefixes:
        n = len(p) // bs
        cache.insert_prefix(p, list(range(next_id, next_id + n)))
        next_id += n
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del cache
    return used / len(prefixes)


DEFAULT_KINDS = ("seed-reference", "radix-bs1", "radix-bs1+array", "radix-bs16",
                 "radix-bs16+array", "hash:sha256-bs16", "hash:xxhash-bs16", "hash:builtin-bs16")


def run_ops(kinds: tuple[str, ...] = DEFAULT_KINDS, *, prompts: int = 1000, iters: int = 2000,
            seed: int = 0) -> list[OpsRow]:
    """Run every kind on one workload; the first kind is the baseline for ratios."""
    w = _workload(seed, prompts)
    return [bench_index(k, w, iters) for k in kinds]


def format_table(rows: list[OpsRow]) -> str:
    """A readable table with ratios against the first row (the baseline)."""
    base = rows[0]
    head = (f"{'index':<20}{'match us':>10}{'insert us':>11}{'evict10 us':>12}"
            f"{'B/prefix':>10}   speedup vs {base.index} (match/insert/evict)")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.index:<20}{r.match_us:>10.1f}{r.insert_us:>11.1f}{r.evict10_us:>12.1f}"
            f"{r.bytes_per_prefix:>10.0f}   {base.match_us / r.match_us:6.1f}x "
            f"{base.insert_us / r.insert_us:6.1f}x {base.evict10_us / r.evict10_us:7.1f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry (also ``prefixkv bench ops``)."""
    import argparse

    p = argparse.ArgumentParser(prog="prefixkv bench ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


def add_arguments(p: Any) -> None:
    """Flags of ``prefixkv bench ops``."""
    p.add_argument("--kinds", nargs="+", default=list(DEFAULT_KINDS),
                   help="index kinds; the first is the baseline (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=1000, help="cached 1,024-token prompts")
    p.add_argument("--iters", type=int, default=2000, help="calls per measured operation")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def run_from_args(args: Any) -> int:
    """Run with parsed arguments; prints the table, optionally writes JSON."""
    if args.prompts <= 0 or args.iters <= 0:
        raise ValueError("--prompts and --iters must be positive")
    rows = run_ops(tuple(args.kinds), prompts=args.prompts, iters=args.iters, seed=args.seed)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
