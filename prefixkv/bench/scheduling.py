"""Schedule policies on seed 003's workloads submitted together: ``fcfs`` vs ``lpm`` / ``dfs-weight``.

``prefixkv bench scenarios --schedule-policies fcfs lpm --num-kv-blocks N`` runs this instead of
the one-request-at-a-time scenarios. Several instances of few-shot, self-consistency,
tree-of-thought and multi-turn (different seeds, so different prefixes) are interleaved
round-robin and submitted at once to one engine (the demo model), so the waiting queue is long
and, with a small pool, shared prefixes compete for KV blocks. Multi-turn follow-ups are
submitted in waves, as soon as their previous turn has finished. Reported per policy (medians
over interleaved rounds, same run): prompt tokens computed (not served from the cache),
preemptions, wall time and throughput (prompt + generated tokens per second).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from prefixkv.bench.scenarios import SCENARIOS, Request

WORKLOADS = ("few-shot", "self-consistency", "tree-of-thought", "multi-turn")


@dataclass(slots=True)
class PolicyResult:
    """Medians over rounds for one policy."""

    policy: str
    requests: int
    prompt_tokens: int
    computed_tokens: int
    preemptions: int
    wall_s: float
    tokens_per_s: float


def mixed_workload(scale: int, seed: int, instances: int) -> list[tuple[Request, int | None]]:
    """``(request, index of the request whose output it extends or None)``, interleaved."""
    groups: list[list[tuple[Request, int | None]]] = []
    for w in WORKLOADS:
        for j in range(instances):
            reqs = SCENARIOS[w](random.Random(seed * 1000 + 17 * j + len(w)), scale)
            step = 2 if w == "multi-turn" else 1  # two conversations interleaved turn by turn
            groups.append([(r, k - step if r.follow_up else None) for k, r in enumerate(reqs)])
    depth = max(len(g) for g in groups)
    order = [(gi, i) for i in range(depth) for gi, g in enumerate(groups) if i < len(g)]
    where = {key: pos for pos, key in enumerate(order)}  # (group, index) -> interleaved position
    out: list[tuple[Request, int | None]] = []
    for gi, i in order:
        req, dep = groups[gi][i]
        out.append((req, None if dep is None else where[(gi, dep)]))
    return out


def run_policy(policy: str, *, num_kv_blocks: int, scale: int, seed: int, instances: int,
               engine_kwargs: dict[str, Any] | None = None) -> PolicyResult:
    """One run of the mixed workload under ``policy`` on a fresh engine (demo model)."""
    from prefixkv.engine import LLM, SamplingParams

    work = mixed_workload(scale, seed, instances)
    llm = LLM(num_kv_blocks=num_kv_blocks, schedule_policy=policy, **(engine_kwargs or {}))
    llm.generate([list(range(40))], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    llm.reset_prefix_cache()
    engine = llm.engine
    outputs: dict[int, Any] = {}
    ids: dict[str, int] = {}
    submitted: set[int] = set()
    t0 = time.perf_counter()
    while len(outputs) < len(work):
        for i, (req, dep) in enumerate(work):
            if i in submitted or (dep is not None and dep not in outputs):
                continue
            prompt = req.prompt
            if req.follow_up is not None and dep is not None:
                prev = outputs[dep]
                prompt = req.follow_up(list(prev.prompt_token_ids) + list(prev.outputs[0].token_ids))
            params = SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens,
                                    seed=req.seed, ignore_eos=True)
            ids[engine.add_request(prompt, params)] = i
            submitted.add(i)
        for out in engine.step():
            if out.finished:
                outputs[ids[out.request_id]] = out
    wall = time.perf_counter() - t0
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs.values())
    cached = sum(o.num_cached_tokens for o in outputs.values())
    generated = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    return PolicyResult(policy, len(work), prompt_tokens, prompt_tokens - cached,
                        engine.scheduler.num_preemptions, wall, (prompt_tokens + generated) / wall)


def compare(policies: list[str], *, rounds: int, **kwargs: Any) -> list[PolicyResult]:
    """Interleaved rounds (policy A, B, A, B, ...); per policy the median of each figure."""
    runs: dict[str, list[PolicyResult]] = {p: [] for p in policies}
    for _ in range(rounds):
        for p in policies:
            runs[p].append(run_policy(p, **kwargs))
    out = []
    for p, rs in runs.items():
        out.append(PolicyResult(
            p, rs[0].requests, rs[0].prompt_tokens,
            int(statistics.median(r.computed_tokens for r in rs)),
            int(statistics.median(r.preemptions for r in rs)),
            statistics.median(r.wall_s for r in rs),
            statistics.median(r.tokens_per_s for r in rs),
        ))
    return out


def format_table(rows: list[PolicyResult]) -> str:
    """One line per policy, with ratios against the first (the baseline, normally fcfs)."""
    base = rows[0]
    head = (f"{'policy':<12}{'requests':>9}{'prompt':>9}{'computed':>10}{'vs base':>9}"
            f"{'preempt':>9}{'wall s':>8}{'tok/s':>9}{'vs base':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.policy:<12}{r.requests:>9}{r.prompt_tokens:>9}{r.computed_tokens:>10}"
            f"{r.computed_tokens / max(1, base.computed_tokens):>8.2f}x{r.preemptions:>9}"
            f"{r.wall_s:>8.2f}{r.tokens_per_s:>9.0f}{r.tokens_per_s / base.tokens_per_s:>8.2f}x"
        )
    return "\n".join(lines)
