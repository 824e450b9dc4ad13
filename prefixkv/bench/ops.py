"""``prefixkv bench ops``: microbenchmarks of the cache core, equal work on every row.

Workload (issue 2, issue 15): 1,000 cached distinct 1,024-token prompts plus a 2,000-token
system prompt; *match* a 2,048-token prompt sharing the system prompt; *insert* a 1,024-token
sequence sharing 512 tokens with a cached prompt; *evict* 10 leaves' worth of tokens from a
fresh load of the system prompt and the prompts (the same 1,001 leaves on every row, oldest
first; 10 x 1,024 = 10,240 tokens: ``evict(10240 // block_size)`` blocks for
ours, ``evict(num_tokens=10240)`` for SGLang, 640 blocks for vLLM), reporting the tokens and
leaves each call actually freed; memory of 1,000 cached 512-token prefixes (tracemalloc).
Token ids are fresh Python ints in [0, 150000) (a Qwen-size vocabulary), as a tokenizer returns
them; ``--vocab 32000`` draws them from a Llama-2-size vocabulary instead, where the radix tree
keeps 2-byte keys (every id < 2**16).

Input forms: plain kinds pass lists; ``+array`` passes ``array('q')`` (SGLang's key type, so
SGLang rows are compared with these); ``+u32`` passes ``array('I')`` (the radix tree's key type
for a large vocabulary, our fastest form there); ``+u16`` passes ``array('H')`` (its key type
when every id < 2**16, e.g. ``--vocab 32000``). Inputs are built outside the timed calls.

The ids an evict call returns are kept (an engine's pool keeps them), so freeing their int
objects is not timed; SGLang's rows likewise hand their value tensors to the allocator.

Timing: every kind's cache is built first; then each operation runs in interleaved rounds
(every kind takes a turn each round, in rotating order) and the figure is the median over all
calls, with the garbage collector off during timed calls (as ``timeit`` does). Ratios are
against the first kind, measured in the same rounds.

Peers: when ``sglang`` / ``vllm`` import in the running interpreter, their prefix caches run
on the same workload in the same process (:mod:`prefixkv.bench.ops_peers`), and a second
table gives our speedup over each (SGLang rows against our ``+array`` rows of the same block
size; vLLM rows against ``hash:sha256-bs16``).
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
from prefixkv.bench.ops_table import EVICT_TOKENS, OpsRow, format_table
from prefixkv.cache import HASH_ALGOS, BlockPool, HashPrefixCache, RadixPrefixCache

__all__ = ["DEFAULT_KINDS", "EVICT_TOKENS", "MODES", "VOCAB", "OpsRow", "add_arguments",
           "format_table", "main", "run_from_args", "run_ops"]

VOCAB = 150_000


MODES = {"": None, "array": "q", "u32": "I", "u16": "H"}
"""Input modes: ``kind+MODE`` -> the ``array`` typecode the tokens are passed as (``None``: list)."""


@dataclass(slots=True)
class _Subject:
    """One kind, loaded with the workload: the three timed operations and their bookkeeping.

    ``evict(i)`` returns the tokens freed; ``units()`` a running count of leaves (or blocks)
    freed, read outside the timed calls (``None`` where unknown)."""

    kind: str
    match: Callable[[int], Any]
    insert: Callable[[int], Any]
    evict: Callable[[int], int]
    units: Callable[[], int | None]
    memory: Callable[[], float | None]
    freed: list[int]
    note: str = ""


def _fresh(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _copy(tokens: list[int]) -> list[int]:
    """Same values, new int objects (defeats CPython's identity shortcut in comparisons)."""
    return [int(str(t)) for t in tokens]


def _workload(seed: int, n_prompts: int, vocab: int = VOCAB) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        "system": _fresh(rng, 2000, vocab),
        "prompts": [_fresh(rng, 1024, vocab) for _ in range(n_prompts)],
        "suffixes": [_fresh(rng, 512, vocab) for _ in range(400)],
        "query_tail": _fresh(rng, 48, vocab),
        "mem_prefixes": [_fresh(rng, 512, vocab) for _ in range(1000)],
    }


def _parse(kind: str) -> tuple[str, int, str | None]:
    """``radix-bs16+array`` -> (``radix``, 16, ``"q"``): index, block size, input typecode."""
    if kind == "seed-reference":
        return kind, 1, None
    body, plus, mode = kind.partition("+")
    if (plus and not mode) or mode not in MODES:
        raise ValueError(f"unknown input mode in {kind!r} (+array, +u32 or +u16)")
    name, sep, bs = body.rpartition("-bs")
    if not sep or not bs.isdigit():
        raise ValueError(f"bad kind {kind!r}: expected INDEX-bsN[+array|+u32|+u16], e.g. radix-bs16")
    return name, int(bs), MODES[mode]


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
    node = cache.insert_prefix(tokens, [*m.matched_kv_blocks, *ids])
    pool.free(node.returned_block_ids)


def _prepare(kind: str, w: dict[str, Any], *, for_evict: bool = False) -> _Subject:
    """Load one of our kinds (or the seed reference) with the workload; inputs prebuilt.

    ``for_evict``: only the system prompt and the prompts, untouched since they were cached (no
    insert inputs, whose preparation matches half of 400 prompts), so the tree every row
    evicts from is the same: 1,001 leaves under the root, oldest first."""
    if ops_peers.is_peer_kind(kind):
        return _prepare_peer(kind, w, for_evict=for_evict)
    _, bs, code = _parse(kind)
    conv: Callable[[list[int]], Any] = (lambda t: t) if code is None else (
        lambda t: array(code, t))
    total = (2000 + 1024 * len(w["prompts"]) + 512 * len(w["suffixes"])) // bs + 64
    cache = _make(kind, total)
    seed = kind == "seed-reference"
    pool = None if seed else BlockPool(total)
    for p in [w["system"], *w["prompts"]]:
        _insert(cache, pool, p, bs)
    query = conv(_copy(w["system"] + w["query_tail"]))
    base = [_copy(p[:512]) for p in w["prompts"]]
    suffixes = [] if for_evict else w["suffixes"]
    seqs = [conv(base[i % len(base)] + suffixes[i]) for i in range(len(suffixes))]
    if pool is None:
        ids = [list(range(1024)) for _ in seqs]
    else:
        ids = [[*cache.match_prefix(s[:512]).matched_kv_blocks, *(pool.allocate(512 // bs) or [])]
               for s in seqs]
    ask = EVICT_TOKENS // bs
    freed: list[int] = []
    kept: list[Any] = []  # the freed ids stay alive, as in a pool: their deallocation is untimed

    def evict(i: int) -> int:
        ids = cache.evict_lru(ask)
        kept.append(ids)
        freed.append(len(ids) * bs)
        return len(ids) * bs

    def units() -> int | None:
        return None if seed else int(cache.get_stats().evictions)

    def memory() -> float:
        return _memory(kind, [conv(p) for p in w["mem_prefixes"]])

    return _Subject(kind, lambda i: cache.match_prefix(query),
                    lambda i: cache.insert_prefix(seqs[i], ids[i]), evict, units, memory, freed)


def _prepare_peer(kind: str, w: dict[str, Any], *, for_evict: bool = False) -> _Subject:
    """The same workload through a peer adapter; keys and values built outside timed calls.

    ``for_evict``: sized for the system prompt and the prompts only (vLLM's pool would
    otherwise hand out its never-used blocks before evicting any) and no insert inputs."""
    suffixes = [] if for_evict else w["suffixes"]
    peer = ops_peers.make_peer(kind, 2000 + 1024 * len(w["prompts"]) + 512 * len(suffixes))
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
    base = [_copy(p[:512]) for p in w["prompts"]]
    seqs = [peer.insert_input(base[i % len(base)] + suffixes[i], ids(1024))
            for i in range(len(suffixes))]
    units = [0]
    freed: list[int] = []

    def evict(i: int) -> int:
        tokens, n_units = peer.evict_tokens(EVICT_TOKENS)
        units[0] += n_units
        freed.append(tokens)
        return tokens

    return _Subject(kind, lambda i: peer.match(query), lambda i: peer.insert(seqs[i]), evict,
                    lambda: units[0], lambda: peer.memory(w["mem_prefixes"]), freed, peer.note)


def _interleaved(subjects: list[_Subject], op: str, calls: int, rounds: int) -> list[list[int]]:
    """Time ``calls`` calls of ``op`` per subject in ``rounds`` interleaved rounds (the subjects
    take turns in rotating order); returns each subject's call times in ns. GC is off while
    timing, so a full collection over the large cached heaps lands on no one's call."""
    times: list[list[int]] = [[] for _ in subjects]
    per_round = -(-calls // rounds)
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            order = list(range(len(subjects)))
            order = order[r % len(order):] + order[: r % len(order)]
            for j in order:
                fn = getattr(subjects[j], op)
                done = len(times[j])
                for i in range(done, min(calls, done + per_round)):
                    t0 = time.perf_counter_ns()
                    fn(i)
                    times[j].append(time.perf_counter_ns() - t0)
    finally:
        gc.enable()
    return times


def _median_us(times: list[int]) -> float:
    return statistics.median(times) / 1000


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
    """``ValueError`` for a kind :func:`run_ops` cannot run (checked before any run)."""
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


DEFAULT_KINDS = ("seed-reference", "radix-bs1", "radix-bs1+array", "radix-bs1+u32",
                 "radix-bs16", "radix-bs16+array", "radix-bs16+u32", "hash:sha256-bs16",
                 "hash:xxhash-bs16", "hash:builtin-bs16")


def run_ops(kinds: tuple[str, ...] = DEFAULT_KINDS, *, prompts: int = 1000, iters: int = 2000,
            seed: int = 0, rounds: int = 5, vocab: int = VOCAB,
            evict_loads: int = 1) -> list[OpsRow]:
    """Run every kind on one workload, interleaved; the first kind is the baseline for ratios.

    ``iters`` match calls per kind; inserts are the workload's 400 sequences; evict calls are
    ``min(iters, prompts // 20, 50)`` per load (each frees 10 leaves' worth, so half the prompts
    at most go) on ``evict_loads`` fresh loads of every kind, one after the other (more calls
    for the median: one load gives 50). Kinds are ours (``radix-bs16+array``, ``hash:xxhash-bs16``, ...), ``seed-reference``,
    or peers (:func:`prefixkv.bench.ops_peers.parse_peer`); all are checked before anything
    runs (``ValueError`` for a bad one; ``ImportError`` when a peer is not installed).
    """
    if not kinds:
        raise ValueError("kinds must name at least one index")
    if rounds <= 0:
        raise ValueError("rounds must be positive")
    if evict_loads <= 0:
        raise ValueError(f"evict_loads must be positive, got {evict_loads}")
    if vocab < 2:
        raise ValueError(f"vocab must be at least 2, got {vocab}")
    for k in kinds:
        _check_kind(k)
    w = _workload(seed, prompts, vocab)
    subjects = [_prepare(k, w) for k in kinds]
    match = _interleaved(subjects, "match", iters, rounds)
    insert = _interleaved(subjects, "insert", len(w["suffixes"]), rounds)
    # evict from fresh loads: after the insert phase the trees differ in shape (a match that
    # ends inside a node refreshes the whole node in SGLang, only the matched part in ours, so
    # LRU would take other leaves), and equal work means the same 10 leaves on every row
    memory = [s.memory() for s in subjects]
    n_evict = max(1, min(iters, prompts // 20, 50))
    evict: list[list[int]] = [[] for _ in kinds]
    freed: list[list[int]] = [[] for _ in kinds]
    units: list[float | None] = [0.0 for _ in kinds]
    for _ in range(evict_loads):
        del subjects
        subjects = [_prepare(k, w, for_evict=True) for k in kinds]
        before = [s.units() for s in subjects]
        for j, times in enumerate(_interleaved(subjects, "evict", n_evict, rounds)):
            evict[j] += times
            freed[j] += subjects[j].freed
            after, start, total = subjects[j].units(), before[j], units[j]
            units[j] = (None if after is None or start is None or total is None
                        else total + (after - start) / n_evict / evict_loads)
    return [OpsRow(s.kind, _median_us(match[j]), _median_us(insert[j]), _median_us(evict[j]),
                   statistics.median(freed[j]), units[j], memory[j], s.note)
            for j, s in enumerate(subjects)]


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
    p.add_argument("--iters", type=int, default=2000, help="match calls per kind")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--evict-loads", type=int, default=1,
                   help="fresh loads of every kind to evict from, 50 calls each (default: "
                        "%(default)s; more calls make the evict median steadier)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--vocab", type=int, default=VOCAB,
                   help="token ids are drawn from [0, VOCAB) (default: %(default)s)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None,
                   help="also run SGLang's and vLLM's caches (default: when they import)")


def run_from_args(args: Any) -> int:
    """Run with parsed arguments; prints the table, optionally writes JSON."""
    if args.prompts <= 0 or args.iters <= 0 or getattr(args, "rounds", 5) <= 0:
        raise ValueError("--prompts, --iters and --rounds must be positive")
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
    rows = run_ops(kinds, prompts=args.prompts, iters=args.iters, seed=args.seed,
                   rounds=getattr(args, "rounds", 5), vocab=getattr(args, "vocab", VOCAB),
                   evict_loads=getattr(args, "evict_loads", 1))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
