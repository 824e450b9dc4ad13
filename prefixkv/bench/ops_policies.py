"""Per-op cost of each eviction policy (issue 12): ``python -m prefixkv.bench.ops_policies``.

The :mod:`prefixkv.bench.ops` workload (1,000 cached 1,024-token prompts and a 2,000-token
system prompt) on a ``radix-bs16+array`` index, one index per policy, all loaded in one
process; then match, insert and evict (10 leaves' worth: 640 blocks) are timed in interleaved
rounds (every policy takes a turn each round, in rotating order) and each figure is the median
over all calls, reported as a ratio to the first policy's median in the same rounds (``lru``),
so a shared machine's drift lands on every row alike.

Policies are named as in the cache's registry (``lru``, ``ghost``, ``experts``, ...), and
``experts[NAME]`` is :class:`~prefixkv.cache.policy_experts.ExpertsPolicy` started on the
expert ``NAME`` (the others still run in its shadows). The expert each policy has chosen after
the timed calls is reported, so a row says what it measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixkv.bench import ops
from prefixkv.cache import BlockPool, RadixPrefixCache
from prefixkv.cache.policies import POLICIES, EvictionPolicy, make_policy
from prefixkv.cache.policy_experts import EXPERTS, ExpertsPolicy
from prefixkv.cache.policy_ghost import GhostPolicy

BLOCK_SIZE = 16
DEFAULT_POLICIES = ("lru", "experts", "ghost", *(f"experts[{e}]" for e in EXPERTS))


@dataclass(slots=True)
class PolicyOpsRow:
    """One policy's medians (microseconds), ratios to the baseline, the mean index entries
    (radix nodes) each evict call freed, and the expert it ended on (``None`` for a policy
    without experts)."""

    policy: str
    match_us: float
    insert_us: float
    evict_us: float
    match_ratio: float
    insert_ratio: float
    evict_ratio: float
    evict_entries: float
    chosen: str | None


def make_named_policy(name: str) -> EvictionPolicy:
    """A fresh policy for ``name``: a registry name, ``ghost``, or ``experts[EXPERT]``
    (``ExpertsPolicy`` started on ``EXPERT``); ``ValueError`` for anything else."""
    if name == "ghost":
        return GhostPolicy()
    if name.startswith("experts[") and name.endswith("]"):
        first = name[len("experts["):-1]
        if first not in EXPERTS:
            raise ValueError(f"unknown expert {first!r} in {name!r}: one of {EXPERTS}")
        return ExpertsPolicy((first, *(e for e in EXPERTS if e != first)))
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: one of {sorted(POLICIES)}, ghost or "
                         f"experts[EXPERT]")
    return make_policy(name)


class StepClock:
    """A logical clock: each reading is ``step`` seconds after the previous one (so a
    policy's order does not depend on how fast the machine ran the set-up)."""

    __slots__ = ("now", "step")

    def __init__(self, step: float) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _prepare(name: str, w: dict[str, Any], clock_step: float | None, evict_blocks: int,
             ) -> tuple[ops._Subject, EvictionPolicy]:
    """Load a ``radix-bs16+array`` index under the policy ``name`` with the workload (as
    :func:`prefixkv.bench.ops._prepare` does for its kinds; inputs built outside timed calls).
    ``clock_step``: the index reads a :class:`StepClock` of that step (``None``: the wall
    clock, as ``prefixkv bench ops``)."""
    bs = BLOCK_SIZE
    policy = make_named_policy(name)
    total = (2000 + 1024 * len(w["prompts"]) + 512 * len(w["suffixes"])) // bs + 64
    clock: Callable[[], float] = time.monotonic if clock_step is None else StepClock(clock_step)
    cache = RadixPrefixCache(total, bs, eviction_policy=policy, clock=clock)
    pool = BlockPool(total)
    for p in [w["system"], *w["prompts"]]:
        ops._insert(cache, pool, p, bs)
    query = array("q", ops._copy(w["system"] + w["query_tail"]))
    base = [ops._copy(p[:512]) for p in w["prompts"]]
    seqs = [array("q", base[i % len(base)] + w["suffixes"][i]) for i in range(len(w["suffixes"]))]
    ids = [[*cache.match_prefix(s[:512]).matched_kv_blocks, *(pool.allocate(512 // bs) or [])]
           for s in seqs]
    ask = evict_blocks
    freed: list[int] = []
    kept: list[Any] = []  # freed ids stay alive, as in a pool: their deallocation is untimed

    def evict(i: int) -> int:
        got = cache.evict(ask)
        kept.append(got)
        freed.append(len(got) * bs)
        return len(got) * bs

    subject = ops._Subject(name, lambda i: cache.match_prefix(query),
                           lambda i: cache.insert_prefix(seqs[i], ids[i]), evict,
                           lambda: int(cache.get_stats().evictions), lambda: None, freed)
    return subject, policy


def run_policy_ops(policies: Sequence[str] = DEFAULT_POLICIES, *, prompts: int = 1000,
                   iters: int = 2000, evicts: int = 50, rounds: int = 15, seed: int = 0,
                   ops_to_time: Sequence[str] = ("match", "insert", "evict"),
                   clock_step: float | None = 0.01,
                   evict_blocks: int = ops.EVICT_TOKENS // BLOCK_SIZE) -> list[PolicyOpsRow]:
    """Time each policy on one workload, interleaved; the first policy is the baseline.

    ``iters`` match calls and ``len(suffixes)`` (400) insert calls per policy, then
    ``evicts`` evict calls of ``evict_blocks`` blocks each (default 640: 10 of the workload's
    prompts, as ``prefixkv bench ops``; at most ``prompts // 20`` calls of 640: half the
    prompts go).
    Operations left out of ``ops_to_time`` report 0 and a ratio of 0. ``clock_step``
    (default 10 ms a cache call, so the set-up's match of a prompt's first half comes seconds
    after its insert: a counted second visit under every policy's ``min_gap``) makes each
    policy's eviction order the same in every run; ``None`` uses the wall clock.
    """
    if clock_step is not None and not clock_step > 0:
        raise ValueError(f"clock_step must be positive or None, got {clock_step!r}")
    if not policies:
        raise ValueError("policies must name at least one policy")
    if rounds <= 0 or iters <= 0 or evicts <= 0 or evict_blocks <= 0:
        raise ValueError("rounds, iters, evicts and evict_blocks must be positive")
    for op in ops_to_time:
        if op not in ("match", "insert", "evict"):
            raise ValueError(f"unknown op {op!r}: match, insert or evict")
    for name in policies:
        make_named_policy(name)  # every name checked before anything runs
    w = ops._workload(seed, prompts)
    loaded = [_prepare(name, w, clock_step, evict_blocks) for name in policies]
    subjects = [s for s, _ in loaded]
    counts = {"match": iters, "insert": len(w["suffixes"]),
              "evict": max(1, min(evicts, prompts * (1024 // BLOCK_SIZE) // 2 // evict_blocks))}
    med: dict[str, list[float]] = {}
    entries = [0.0] * len(subjects)
    for op in ("match", "insert", "evict"):
        before = [s.units() or 0 for s in subjects]
        if op in ops_to_time:
            times = ops._interleaved(subjects, op, counts[op], rounds)
            med[op] = [statistics.median(t) / 1000 for t in times]
            if op == "evict":
                entries = [((s.units() or 0) - b) / counts[op] for s, b in zip(subjects, before)]
        else:
            med[op] = [0.0] * len(subjects)
    rows = []
    for j, (name, policy) in enumerate(zip(policies, (p for _, p in loaded))):
        def ratio(op: str) -> float:
            return med[op][j] / med[op][0] if med[op][0] else 0.0
        chosen = policy.chosen if isinstance(policy, ExpertsPolicy) else None
        rows.append(PolicyOpsRow(name, med["match"][j], med["insert"][j], med["evict"][j],
                                 ratio("match"), ratio("insert"), ratio("evict"), entries[j],
                                 chosen))
    return rows


def format_rows(rows: Sequence[PolicyOpsRow]) -> str:
    """A plain-text table: ratios to the first row, medians in microseconds."""
    lines = [f"{'policy':<16} {'match':>7} {'insert':>7} {'evict':>7}   "
             f"{'evict us':>9} {'entries/evict':>13}  chosen"]
    for r in rows:
        lines.append(f"{r.policy:<16} {r.match_ratio:>6.2f}x {r.insert_ratio:>6.2f}x "
                     f"{r.evict_ratio:>6.2f}x   {r.evict_us:>9.1f} {r.evict_entries:>13.1f}  "
                     f"{r.chosen or '-'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    """Command line: ``python -m prefixkv.bench.ops_policies [--policies ...] [--ops ...]``."""
    ap = argparse.ArgumentParser(prog="python -m prefixkv.bench.ops_policies",
                                 description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                    help="policies to time; the first is the baseline (default: lru, "
                         "experts, ghost, experts[EXPERT] for every expert)")
    ap.add_argument("--ops", nargs="+", default=["match", "insert", "evict"],
                    choices=["match", "insert", "evict"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=2000, help="match calls per policy")
    ap.add_argument("--evicts", type=int, default=50, help="evict calls per policy")
    ap.add_argument("--evict-blocks", type=int, default=ops.EVICT_TOKENS // BLOCK_SIZE,
                    help="blocks each evict call asks for (default 640: 10 prompts)")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock-step", type=float, default=0.01,
                    help="seconds the index clock moves per cache call (default 0.01); "
                         "0 for the wall clock")
    args = ap.parse_args(argv)
    try:
        rows = run_policy_ops(args.policies, prompts=args.prompts, iters=args.iters,
                              evicts=args.evicts, rounds=args.rounds, seed=args.seed,
                              ops_to_time=args.ops,
                              clock_step=args.clock_step or None,
                              evict_blocks=args.evict_blocks)
    except ValueError as exc:
        ap.error(str(exc))
    out(format_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
