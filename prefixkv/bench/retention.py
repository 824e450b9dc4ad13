"""``python -m prefixkv.bench.retention``: per-session retention against the policy alone on the
real engine, same run.

Soft retention (issue 43; docs/cache.md, "Retention") end to end: requests carry
``SamplingParams(retention=Retention(priority, ttl_s))`` into the engine (the demo model by
default, or ``--model smollm2-135m-instruct``), whose KV pool is small enough that the eviction
policy (``--policy``, default ``experts``, the adaptive one) evicts a session's blocks between
two of its turns. Three rows, each on its own fresh engine (same weights, dtype and config),
fed the same steps *interleaved* (step i goes to every row's engine before step i+1 goes to
any), so the machine's load falls on all rows alike and between two turns of a session every
other session's prompts go through all three pools:

* ``alone``: no request retains (the policy alone);
* ``all``: every request retains (``--ttl``; default: 2x the think time, below);
* ``share``: the requests of ``--share`` of the sessions (a fixed hash, as
  ``prefixkv.bench.trace_retention``) retain; the same sessions form the *retaining group*
  in every row, so each row reports the token hit rate (cached prompt tokens / prompt
  tokens) and TTFT p50/p90 for all requests, that group and the others.

Workloads (``--workload``):

* ``chat``: ``--sessions`` conversations of ``--turns`` turns, a shared system prompt, a
  per-session context, then per turn a user message; each turn's prompt is the previous
  prompt, the model's answer and the new message (seed 003's multi-turn scenario, many
  sessions). Sessions go round-robin, so between two turns of one session every other
  session sends one.
* ``weka``: a slice (``--start``, ``--requests``) of the weka agentic trace, replayed in
  trace order; each 512-token block id becomes ``--tokens-per-id`` demo-vocabulary tokens
  (seeded by the id, so shared ids stay shared prefixes), prompts cut at ``--max-prompt``; a
  session is the requests sharing a first block id.

Think time is real: the wall time between two requests of a session is the time the engines
take for the steps in between. The default TTL is ``2 x p90(steps between a session's
requests) x rows x (one request's time, measured at warm-up)``; the measured gaps are printed
so the TTL can be checked against them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from prefixkv.bench.trace_retention import retains
from prefixkv.cache import Retention

VOCAB = 256  # the demo model's byte tokens
ROWS = ("alone", "all", "share")


@dataclass(frozen=True, slots=True)
class Step:
    """One request: its session, and its tokens (``append``: after the session's history,
    i.e. its previous prompt and answer; else the whole prompt)."""

    session: int
    tokens: tuple[int, ...]
    append: bool


@dataclass(slots=True)
class Group:
    """Totals of a set of requests of one row."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts_ms: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def ttft_ms(self, q: int) -> float:
        """The ``q``-th percentile of TTFT in ms (0.0 when empty)."""
        t = sorted(self.ttfts_ms)
        return t[min(len(t) - 1, q * len(t) // 100)] if t else 0.0


@dataclass(slots=True)
class Row:
    """One variant: all its requests, the retaining group's and the others'."""

    name: str
    ttl_s: float | None
    total: Group = field(default_factory=Group)
    retaining: Group = field(default_factory=Group)
    others: Group = field(default_factory=Group)
    retained_blocks_end: int = 0


def chat_steps(sessions: int, turns: int, *, system: int = 64, context: int = 192,
               user: int = 32, seed: int = 0) -> list[Step]:
    """Round-robin multi-turn chat: turn t of every session, then turn t+1."""
    if sessions < 1 or turns < 1:
        raise ValueError(f"sessions and turns must be >= 1, got {sessions}, {turns}")
    rng = random.Random(seed)
    sys_p = tuple(rng.randrange(VOCAB) for _ in range(system))
    ctx = [tuple(rng.randrange(VOCAB) for _ in range(context)) for _ in range(sessions)]
    out = []
    for t in range(turns):
        for s in range(sessions):
            msg = tuple(rng.randrange(VOCAB) for _ in range(user))
            out.append(Step(s, sys_p + ctx[s] + msg, False) if t == 0 else Step(s, msg, True))
    return out


def weka_steps(path: str, *, start: int, requests: int, tokens_per_id: int,
               max_prompt: int) -> list[Step]:
    """A slice of a Mooncake-format trace, each block id mapped to ``tokens_per_id`` tokens."""
    from prefixkv.bench.trace import load_trace

    out = []
    for r in load_trace(path)[start:start + requests]:
        toks: list[int] = []
        for h in r.hash_ids:
            rng = random.Random(h)
            toks += [rng.randrange(VOCAB) for _ in range(tokens_per_id)]
            if len(toks) >= max_prompt:
                break
        if r.hash_ids:
            out.append(Step(r.hash_ids[0], tuple(toks[:max_prompt]), False))
    return out


def step_gaps(steps: Sequence[Step]) -> list[int]:
    """Steps between consecutive requests of one session."""
    last: dict[int, int] = {}
    gaps = []
    for i, s in enumerate(steps):
        if s.session in last:
            gaps.append(i - last[s.session])
        last[s.session] = i
    return gaps


def run(steps: Sequence[Step], *, num_kv_blocks: int, share: float = 0.25,
        ttl_s: float | None = None, policy: str = "experts", priority: int = 50,
        block_size: int = 16, max_tokens: int = 8, model: str | None = None,
        ttl_factor: float = 2.0) -> tuple[list[Row], dict[str, Any]]:
    """Run ``steps`` through one fresh engine per row, interleaved; returns the rows and the
    run's facts (TTL, gaps, per-request time)."""
    from prefixkv.engine import LLM, SamplingParams

    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    kw: dict[str, Any] = dict(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              eviction_policy=policy)
    llms = [LLM(model, **kw) for _ in ROWS]
    mean_len = statistics.mean(len(s.tokens) for s in steps if not s.append) if steps else 1
    t_req = _warm_up(llms, SamplingParams, int(mean_len), max_tokens)
    gaps = step_gaps(steps)
    p90 = statistics.quantiles(gaps, n=10)[-1] if len(gaps) > 1 else float(gaps[0] if gaps else 1)
    if ttl_s is None:
        ttl_s = ttl_factor * p90 * len(ROWS) * t_req
    ret = Retention(priority=priority, ttl_s=ttl_s)
    rows = [Row(n, None if n == "alone" else ttl_s) for n in ROWS]
    mine = {s.session for s in steps if retains(s.session, share)}
    histories: list[dict[int, list[int]]] = [{} for _ in ROWS]
    seen: dict[int, float] = {}
    wall_gaps = []
    t0 = time.perf_counter()
    for i, step in enumerate(steps):
        now = time.perf_counter()
        if step.session in seen:
            wall_gaps.append(now - seen[step.session])
        seen[step.session] = now
        order = [(i + k) % len(ROWS) for k in range(len(ROWS))]  # who goes first rotates
        for k in order:
            row, hist = rows[k], histories[k]
            asks = row.name == "all" or (row.name == "share" and step.session in mine)
            prompt = (hist.get(step.session, []) if step.append else []) + list(step.tokens)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    retention=ret if asks else None)
            out = llms[k].generate([prompt], params, use_tqdm=False)[0]
            hist[step.session] = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            for g in (row.total, row.retaining if step.session in mine else row.others):
                g.requests += 1
                g.prompt_tokens += len(out.prompt_token_ids)
                g.cached_tokens += out.num_cached_tokens
                if out.ttft is not None:
                    g.ttfts_ms.append(1000 * out.ttft)
    for row, llm in zip(rows, llms):
        stats = llm.get_cache_stats()
        row.retained_blocks_end = stats.retained_blocks if stats else 0
    facts = {"ttl_s": ttl_s, "request_s": t_req, "gap_steps_p90": p90, "steps": len(steps),
             "sessions": len({s.session for s in steps}), "retaining_sessions": len(mine),
             "wall_gap_s": _pcts(wall_gaps), "seconds": time.perf_counter() - t0,
             "num_kv_blocks": num_kv_blocks, "policy": policy, "block_size": block_size,
             "working_set_blocks": _working_set(steps, block_size, max_tokens)}
    return rows, facts


def _warm_up(llms: Sequence[Any], sampling_params: Any, length: int, max_tokens: int) -> float:
    """A throwaway request per engine (first torch calls are slow), then two timed ones,
    then empty caches; returns the timed requests' median (``length`` prompt tokens,
    uncached)."""
    rng = random.Random(12345)
    times = []
    for llm in llms:
        for i in range(3):
            p = [rng.randrange(VOCAB) for _ in range(max(1, length))]
            t = time.perf_counter()
            llm.generate([p], sampling_params(temperature=0.0, max_tokens=max_tokens,
                                              ignore_eos=True), use_tqdm=False)
            if i:
                times.append(time.perf_counter() - t)
        llm.reset_prefix_cache()
        if llm.engine.kv.cache is not None:
            llm.engine.kv.cache.reset_stats()
    return statistics.median(times)


def _working_set(steps: Sequence[Step], block_size: int, max_tokens: int) -> int:
    """Full blocks of every session's longest prompt (about: answers counted as max_tokens)."""
    longest: dict[int, int] = {}
    for s in steps:
        prev = longest.get(s.session, 0)
        n = (prev + max_tokens if s.append else 0) + len(s.tokens)
        longest[s.session] = max(prev, n)
    return sum(n // block_size for n in longest.values())


def _pcts(xs: Sequence[float]) -> dict[str, float]:
    if len(xs) < 2:
        return {"p50": xs[0] if xs else 0.0, "p90": xs[0] if xs else 0.0}
    q = statistics.quantiles(xs, n=10)
    return {"p50": statistics.median(xs), "p90": q[-1]}


def format_table(rows: Sequence[Row], facts: dict[str, Any]) -> str:
    """One line per row: hit rate and TTFT p50/p90, overall, retaining group, the others."""
    head = (f"{'row':<6} {'hit':>6} {'p50 ms':>7} {'p90 ms':>7} | {'ret hit':>7} {'p50':>6} "
            f"{'p90':>6} | {'oth hit':>7} {'p50':>6} {'p90':>6} | {'prompt tok':>10}")
    lines = [head]
    for r in rows:
        t, a, o = r.total, r.retaining, r.others
        lines.append(f"{r.name:<6} {t.hit_rate:6.3f} {t.ttft_ms(50):7.1f} {t.ttft_ms(90):7.1f} | "
                     f"{a.hit_rate:7.3f} {a.ttft_ms(50):6.1f} {a.ttft_ms(90):6.1f} | "
                     f"{o.hit_rate:7.3f} {o.ttft_ms(50):6.1f} {o.ttft_ms(90):6.1f} | "
                     f"{t.prompt_tokens:10d}")
    g = facts["wall_gap_s"]
    lines.append(f"{facts['sessions']} sessions ({facts['retaining_sessions']} retaining), "
                 f"{facts['steps']} requests per row, pool {facts['num_kv_blocks']} blocks of "
                 f"{facts['block_size']} (working set ~{facts['working_set_blocks']}), policy "
                 f"{facts['policy']}; TTL {facts['ttl_s']:.1f} s; a session's gap p50 "
                 f"{g['p50']:.1f} s, p90 {g['p90']:.1f} s; {facts['seconds']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module doc)."""
    p = argparse.ArgumentParser(prog="python -m prefixkv.bench.retention",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--workload", choices=("chat", "weka"), default="chat")
    p.add_argument("--sessions", type=int, default=16, help="chat: conversations")
    p.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    p.add_argument("--trace", default="data/weka_agentic/weka_agentic_a.jsonl.gz",
                   help="weka: the trace (Mooncake JSONL, .gz)")
    p.add_argument("--start", type=int, default=0, help="weka: first request of the slice")
    p.add_argument("--requests", type=int, default=120, help="weka: requests in the slice")
    p.add_argument("--tokens-per-id", type=int, default=4, help="weka: tokens per block id")
    p.add_argument("--max-prompt", type=int, default=1024, help="weka: prompt cut (tokens)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool blocks (default: a third of the working set)")
    p.add_argument("--share", type=float, default=0.25, help="sessions retaining in 'share'")
    p.add_argument("--ttl", type=float, default=None, help="TTL s (default: 2x think time)")
    p.add_argument("--policy", default="experts", help="eviction policy (default experts)")
    p.add_argument("--priority", type=int, default=50)
    p.add_argument("--model", default=None, help="model (default: the demo model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write rows and facts as JSON")
    a = p.parse_args(argv)
    if a.workload == "chat":
        steps = chat_steps(a.sessions, a.turns, seed=a.seed)
    else:
        steps = weka_steps(a.trace, start=a.start, requests=a.requests,
                           tokens_per_id=a.tokens_per_id, max_prompt=a.max_prompt)
    blocks = a.num_kv_blocks or max(64, _working_set(steps, 16, 8) // 3)
    rows, facts = run(steps, num_kv_blocks=blocks, share=a.share, ttl_s=a.ttl, policy=a.policy,
                      priority=a.priority, model=a.model)
    print(format_table(rows, facts))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"facts": facts, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
