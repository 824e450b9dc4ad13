"""``prefixkv bench ops``: microbenchmarks of the cache core (issue 2's workload).

Workload: 1,000 cached distinct 1,024-token prompts plus a 2,000-token system prompt; match a
2,048-token prompt sharing the system prompt; insert a 1,024-token sequence sharing 512 tokens
with a cached prompt; evict 10 blocks from a full cache; memory of 1,000 cached 512-token
prefixes (tracemalloc). Token ids are fresh Python ints in [0, 150000), as a tokenizer returns
them (so equal tokens are equal values, not the same objects).

Every figure is a median over many calls, and is also given as a ratio against seed 004's
reference radix tree (:mod:`prefixkv.bench.ops_baseline`) measured in the same run.

Peers: when ``sglang`` / ``vllm`` import in the running interpreter, their prefix caches run
on the same workload in the same process (:mod:`prefixkv.bench.ops_peers`), and a second
table gives our speedup over each (SGLang rows against our ``+array`` rows, since SGLang's
keys are arrays; vLLM rows against ``hash:sha256-bs16``).
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
import tracemalloc
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from prefixkv.bench import ops_peers
from prefixkv.bench.ops_baseline import SeedReferenceRadix
from prefixkv.cache import HASH_ALGOS, BlockPool, HashPrefixCache, RadixPrefixCache

VOCAB = 150_000


@dataclass(slots=True)
class OpsRow:
    """One index's medians (microseconds) and memory (bytes per cached prefix; ``None`` where
    it cannot be measured). ``note`` says what a peer's figures count (empty for ours)."""

    index: str
    match_us: float
    insert_us: float
    evict10_us: float
    bytes_per_prefix: float | None
    note: str = ""


def _fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _copy(tokens: list[int]) -> list[int]:
    """Same values, new int objects (defeats CPython's identity shortcut in comparisons)."""
    return [int(str(t)) for t in tokens]


def _median_us(fn: Callable[[int], Any], n: int) -> float:
    """Median of ``n`` timed calls, with the garbage collector off (as ``timeit`` does), so a
    full collection over the large cached heap does not land on whichever call triggers it."""
    times = []
    gc.collect()
    gc.disable()
    try:
        for i in range(n):
            t0 = time.perf_counter_ns()
            fn(i)
            times.append(time.perf_counter_ns() - t0)
    finally:
        gc.enable()
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
    """Measure one index kind (ours, the seed reference, or a peer) on the shared workload."""
    if ops_peers.is_peer_kind(kind):
        return _bench_peer(kind, w, iters)
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


def _bench_peer(kind: str, w: dict[str, Any], iters: int) -> OpsRow:
    """Same workload and timed calls as :func:`bench_index`, through a peer adapter. Keys and
    values (block ids) are built outside the timed region, as for ours."""
    peer = ops_peers.make_peer(kind, 2000 + 1024 * len(w["prompts"]) + 512 * len(w["suffixes"]))
    bs = peer.block_size
    next_id = 0

    def ids(n_tokens: int) -> list[int]:
        nonlocal next_id
        next_id += n_tokens // bs
        return list(range(next_id - n_tokens // bs, next_id))

    for p in [w["system"], *w["prompts"]]:
        peer.insert(peer.insert_input(p, ids(len(p))))
    query = peer.key(_copy(w["system"] + w["query_tail"]))
    if peer.match(query) != 2000:
        raise RuntimeError(f"{kind}: the query should match the 2,000-token system prompt")
    match_us = _median_us(lambda i: peer.match(query), iters)

    base = [_copy(p[:512]) for p in w["prompts"]]
    seqs = [peer.insert_input(base[i % len(base)] + w["suffixes"][i], ids(1024))
            for i in range(len(w["suffixes"]))]
    insert_us = _median_us(lambda i: peer.insert(seqs[i]), len(seqs))

    n_evict = min(iters, 200)
    freed = [0] * n_evict

    def evict(i: int) -> None:
        freed[i] = peer.evict(10)

    evict_us = _median_us(evict, n_evict)
    note = f"evict(10 blocks = {10 * bs} tokens) freed {statistics.median(freed):.0f} tokens"
    if isinstance(peer, ops_peers.SGLangPeer):
        # SGLang frees whole leaves: also time asking for 10 leaves' worth of tokens.
        ask = int(10 * statistics.median(freed))
        got: list[tuple[int, int]] = [(0, 0)] * min(iters, 20)

        def evict_more(i: int) -> None:
            got[i] = peer.evict_tokens(ask)

        leaves_us = _median_us(evict_more, len(got))
        note += (f"; asking {ask} freed {statistics.median(g[1] for g in got):.0f} leaves "
                 f"in {leaves_us:.1f} us")
    return OpsRow(kind, match_us, insert_us, evict_us, peer.memory(w["mem_prefixes"]), note)


def _memory(kind: str, prefixes: list[Any]) -> float:
    _, bs, _ = _parse(kind)
    # block ids are created before measuring: an engine's pool creates them once, up front
    id_lists = []
    next_id = 0
    for p in prefixes:
        id_lists.append(list(range(next_id, next_id + len(p) // bs)))
        next_id += len(p) // bs
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = _make(kind, next_id + 8)
    for p, ids in zip(prefixes, id_lists):
        cache.insert_prefix(p, ids)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del cache
    return used / len(prefixes)


def _check_kind(kind: str) -> None:
    """``ValueError`` for a kind :func:`bench_index` cannot run (checked before any run)."""
    if ops_peers.is_peer_kind(kind):
        ops_peers.parse_peer(kind)
        return
    name, bs, _ = _parse(kind)
    index, _, algo = name.partition(":")
    known = (name in ("seed-reference", "radix", "hash")
             or (index == "hash" and algo in HASH_ALGOS))
    if not known or bs <= 0:
        raise ValueError(f"unknown index in kind {kind!r}: expected seed-reference, radix-bsN, "
                         f"hash[:{'|'.join(HASH_ALGOS)}]-bsN or a peer kind")


DEFAULT_KINDS = ("seed-reference", "radix-bs1", "radix-bs1+array", "radix-bs16",
                 "radix-bs16+array", "hash:sha256-bs16", "hash:xxhash-bs16", "hash:builtin-bs16")


def run_ops(kinds: tuple[str, ...] = DEFAULT_KINDS, *, prompts: int = 1000, iters: int = 2000,
            seed: int = 0) -> list[OpsRow]:
    """Run every kind on one workload; the first kind is the baseline for ratios.

    Kinds are ours (``radix-bs16+array``, ``hash:xxhash-bs16``, ...), ``seed-reference``, or
    peers (:func:`prefixkv.bench.ops_peers.parse_peer`); all are checked before anything runs
    (``ValueError`` for a bad one; ``ImportError`` when a peer is not installed).
    """
    if not kinds:
        raise ValueError("kinds must name at least one index")
    for k in kinds:
        _check_kind(k)
    w = _workload(seed, prompts)
    return [bench_index(k, w, iters) for k in kinds]


def _fmt_bytes(b: float | None) -> str:
    return "n/a" if b is None else f"{b:.0f}"


def format_table(rows: list[OpsRow]) -> str:
    """A readable table with ratios against the first row (the baseline); when peer rows are
    present, a second table of our speedup over each peer, and notes on the peers' units."""
    base = rows[0]
    head = (f"{'index':<28}{'match us':>10}{'insert us':>11}{'evict10 us':>12}"
            f"{'B/prefix':>10}   speedup vs {base.index} (match/insert/evict)")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.index:<28}{r.match_us:>10.1f}{r.insert_us:>11.1f}{r.evict10_us:>12.1f}"
            f"{_fmt_bytes(r.bytes_per_prefix):>10}   {base.match_us / r.match_us:6.1f}x "
            f"{base.insert_us / r.insert_us:6.1f}x {base.evict10_us / r.evict10_us:7.1f}x"
        )
    peers = [r for r in rows if ops_peers.is_peer_kind(r.index)]
    if peers:
        lines += ["", _format_vs_peers(rows, peers)]
    return "\n".join(lines)


def _ours_for(peer: str, ours: dict[str, OpsRow]) -> OpsRow | None:
    """Our row to compare a peer with: same block size, array input for SGLang, sha256 hash
    index for vLLM."""
    name, _, bs, _ = ops_peers.parse_peer(peer)
    wanted = (["hash:sha256-bs16"] if name == "vllm"
              else [f"radix-bs{bs}+array", f"radix-bs{bs}"])
    return next((ours[k] for k in wanted if k in ours), None)


def _format_vs_peers(rows: list[OpsRow], peers: list[OpsRow]) -> str:
    ours = {r.index: r for r in rows if not ops_peers.is_peer_kind(r.index)}
    head = f"{'peer':<28}{'ours':<20}  our speedup (match/insert/evict)   peer's units"
    lines = [head, "-" * len(head)]
    for p in peers:
        o = _ours_for(p.index, ours)
        ratios = ("   (no comparable row of ours)" if o is None else
                  f"{p.match_us / o.match_us:7.1f}x {p.insert_us / o.insert_us:6.1f}x "
                  f"{p.evict10_us / o.evict10_us:7.1f}x")
        lines.append(f"{p.index:<28}{o.index if o else '-':<20}{ratios:<34}   {p.note}")
    families = sorted({"vllm" if p.index.startswith("vllm") else "sglang" for p in peers})
    lines += [""] + [f"* {ops_peers.NOTES[f]}" for f in families]
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
    import argparse

    p.add_argument("--kinds", nargs="+", default=list(DEFAULT_KINDS),
                   help="index kinds; the first is the baseline (default: %(default)s); "
                        "peer kinds: " + ", ".join(ops_peers.SGLANG_KINDS + ops_peers.VLLM_KINDS))
    p.add_argument("--prompts", type=int, default=1000, help="cached 1,024-token prompts")
    p.add_argument("--iters", type=int, default=2000, help="calls per measured operation")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None,
                   help="also run SGLang's and vLLM's caches (default: when they import)")


def run_from_args(args: Any) -> int:
    """Run with parsed arguments; prints the table, optionally writes JSON."""
    if args.prompts <= 0 or args.iters <= 0:
        raise ValueError("--prompts and --iters must be positive")
    kinds = tuple(args.kinds)
    peers = getattr(args, "peers", None)
    if peers is not False and not any(ops_peers.is_peer_kind(k) for k in kinds):
        found, missing = ops_peers.available_peers()
        if peers and missing:
            raise ValueError("--peers: not installed: " + "; ".join(missing))
        print("peers: " + (", ".join(found) if found else "not installed"))
        if found and missing:
            print("peers not installed: " + "; ".join(missing))
        kinds += found
    rows = run_ops(kinds, prompts=args.prompts, iters=args.iters, seed=args.seed)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
