"""``prefixkv bench scenarios``: seed 003's use cases run end to end through the engine.

Each scenario is a list of requests sent one after another (so later requests can hit what
earlier ones cached), run on the real engine with the built-in demo model under several cache
configurations: the radix index at block size 1 (SGLang-like, token exact) and 16, the hash
index at block size 16 (vLLM-like), and no prefix cache. Reported per scenario and config:
prompt tokens, tokens reused (full blocks, plus partial rows copied), the share of prefill
saved, the index's query and token hit rates, and mean TTFT.

Scenarios (token ids from a seeded generator over the demo model's byte vocabulary, except the
document one, which is seed 003's markdown table through the tokenizer):

* ``system-prompt``: one long system prompt, many different user questions.
* ``few-shot``: shared examples, different questions.
* ``self-consistency``: one question sampled several times (temperature > 0).
* ``multi-turn``: conversations whose history (with the model's answers) grows each turn.
* ``tree-of-thought``: a question, branches, and sub-branches sharing their history.
* ``long-document``: seed 003's markdown table, two questions (the second is faster).
* ``seed-002``: a 26-token system prompt and two short questions at block size 16: plain
  block matching reuses 16 of the 26 tokens (61%); token-exact reuse, all 26.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

VOCAB = 256  # the demo model's byte tokens


@dataclass(slots=True)
class Request:
    """One request of a scenario: a prompt (token ids or text) and how many tokens to sample."""

    prompt: Any
    max_tokens: int = 4
    temperature: float = 0.0
    seed: int | None = None
    follow_up: Callable[[list[int]], list[int]] | None = None  # multi-turn: next prompt builder


@dataclass(slots=True)
class ScenarioResult:
    """Totals of one scenario under one cache configuration."""

    scenario: str
    config: str
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    block_cached_tokens: int
    saved_fraction: float
    query_hit_rate: float
    token_hit_rate: float
    mean_ttft_ms: float
    last_ttft_ms: float


CONFIGS: dict[str, dict[str, Any]] = {
    "radix-bs1": {"index": "radix", "block_size": 1},
    "radix-bs16": {"index": "radix", "block_size": 16},
    "hash-bs16": {"index": "hash", "block_size": 16},
    "no-cache": {"enable_prefix_caching": False, "block_size": 16},
}


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _system_prompt(rng: random.Random, scale: int) -> list[Request]:
    system = _toks(rng, 256 * scale)
    return [Request(system + _toks(rng, 24 + 8 * i)) for i in range(8)]


def _few_shot(rng: random.Random, scale: int) -> list[Request]:
    examples = [t for _ in range(4) for t in _toks(rng, 64 * scale)]
    return [Request(examples + _toks(rng, 32)) for _ in range(6)]


def _self_consistency(rng: random.Random, scale: int) -> list[Request]:
    question = _toks(rng, 256 * scale)
    return [Request(question, max_tokens=8, temperature=0.8, seed=i) for i in range(6)]


def _multi_turn(rng: random.Random, scale: int) -> list[Request]:
    system = _toks(rng, 64 * scale)
    out = []
    for _ in range(2):
        turns = [_toks(rng, 48) for _ in range(4)]
        out.append(_Conversation(system, turns).requests())
    # interleave the conversations turn by turn
    return [r for group in zip(*out) for r in group]


class _Conversation:
    """Builds turn k's prompt from turn k-1's prompt and answer (filled in at run time)."""

    def __init__(self, system: list[int], turns: list[list[int]]) -> None:
        self.system, self.turns = system, turns

    def requests(self) -> list[Request]:
        reqs = [Request(self.system + self.turns[0], max_tokens=8)]
        for user in self.turns[1:]:
            reqs.append(Request(None, max_tokens=8, follow_up=_append(user)))
        return reqs


def _append(user: list[int]) -> Callable[[list[int]], list[int]]:
    """The next turn's prompt: the conversation so far plus the user's new message."""
    def follow_up(history: list[int]) -> list[int]:
        return history + user
    return follow_up


def _tree_of_thought(rng: random.Random, scale: int) -> list[Request]:
    root = _toks(rng, 192 * scale)
    out = []
    for _ in range(3):
        branch = root + _toks(rng, 48)
        out += [Request(branch + _toks(rng, 24)) for _ in range(2)]
    return out


def _long_document(rng: random.Random, scale: int) -> list[Request]:
    from prefixkv.bench.seed_table import LONG_PROMPT

    doc = LONG_PROMPT  # seed 003's document as is (4.3k tokens; not scaled past the context)
    return [Request(doc + f"Question: what is the age of {name}? Your answer: The age of "
                    f"{name} is ", max_tokens=8) for name in ("John Doe", "Zack Blue")]


def _seed_002(rng: random.Random, scale: int) -> list[Request]:
    system = _toks(rng, 26)
    return [Request(system + _toks(rng, 4), max_tokens=4), Request(system + _toks(rng, 5))]


SCENARIOS: dict[str, Callable[[random.Random, int], list[Request]]] = {
    "system-prompt": _system_prompt,
    "few-shot": _few_shot,
    "self-consistency": _self_consistency,
    "multi-turn": _multi_turn,
    "tree-of-thought": _tree_of_thought,
    "long-document": _long_document,
    "seed-002": _seed_002,
}


def run_scenario(name: str, config: str, *, scale: int = 1, seed: int = 0,
                 engine_kwargs: dict[str, Any] | None = None) -> ScenarioResult:
    """Run one scenario under one configuration on a fresh engine (the demo model)."""
    from prefixkv.engine import LLM, SamplingParams

    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose from {sorted(SCENARIOS)}")
    if config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}; choose from {sorted(CONFIGS)}")
    requests = SCENARIOS[name](random.Random(seed), scale)
    llm = LLM(**CONFIGS[config], **(engine_kwargs or {}))
    _warm_up(llm, SamplingParams)
    prompt_tokens = cached = 0
    ttfts: list[float] = []
    histories: dict[int, list[int]] = {}
    n_convs = 2 if name == "multi-turn" else 1
    for i, req in enumerate(requests):
        prompt = req.prompt
        if req.follow_up is not None:
            prompt = req.follow_up(histories[i - n_convs])
        params = SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens,
                                seed=req.seed, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        histories[i] = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        prompt_tokens += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        if out.ttft is not None:
            ttfts.append(out.ttft)
    stats = llm.get_cache_stats()
    return ScenarioResult(
        scenario=name,
        config=config,
        policy=llm.engine.kv.cache.policy.name if llm.engine.kv.cache is not None else "-",
        requests=len(requests),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        block_cached_tokens=stats.matched_tokens if stats else 0,
        saved_fraction=cached / prompt_tokens if prompt_tokens else 0.0,
        query_hit_rate=stats.query_hit_rate if stats else 0.0,
        token_hit_rate=stats.token_hit_rate if stats else 0.0,
        mean_ttft_ms=1000 * statistics.mean(ttfts) if ttfts else 0.0,
        last_ttft_ms=1000 * ttfts[-1] if ttfts else 0.0,
    )


def _warm_up(llm: Any, sampling_params: Any) -> None:
    """One throwaway request (first torch calls are slow), then an empty cache and counters."""
    llm.generate([list(range(40))], sampling_params(temperature=0, max_tokens=2), use_tqdm=False)
    llm.reset_prefix_cache()
    cache = llm.engine.kv.cache
    if cache is not None:
        cache.reset_stats()


def format_table(rows: list[ScenarioResult]) -> str:
    """People's view: one line per scenario and configuration."""
    head = (f"{'scenario':<18}{'config':<12}{'policy':<7}{'prompt':>8}{'reused':>8}{'blocks':>8}"
            f"{'saved':>8}{'q-hit':>7}{'t-hit':>7}{'TTFT ms':>9}{'vs none':>9}")
    lines = [head, "-" * len(head)]
    base = {r.scenario: r.mean_ttft_ms for r in rows if r.config == "no-cache"}
    for r in rows:
        b = base.get(r.scenario)
        ratio = f"{b / r.mean_ttft_ms:>8.1f}x" if b and r.mean_ttft_ms else f"{'-':>9}"
        lines.append(
            f"{r.scenario:<18}{r.config:<12}{r.policy:<7}{r.prompt_tokens:>8}{r.cached_tokens:>8}"
            f"{r.block_cached_tokens:>8}{r.saved_fraction:>8.1%}{r.query_hit_rate:>7.2f}"
            f"{r.token_hit_rate:>7.2f}{r.mean_ttft_ms:>9.1f}{ratio}"
        )
    return "\n".join(lines)


def plot(rows: list[ScenarioResult], path: str) -> None:
    """Bar chart: prefill saved per scenario, one bar per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r.scenario for r in rows))
    def label(r: ScenarioResult) -> str:
        return r.config if r.policy in ("-", "lru") else f"{r.config}/{r.policy}"

    configs = list(dict.fromkeys(label(r) for r in rows))
    width = 0.8 / max(1, len(configs))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for j, cfg in enumerate(configs):
        vals = {r.scenario: r for r in rows if label(r) == cfg}
        xs = [i + j * width for i in range(len(scenarios))]
        axes[0].bar(xs, [100 * vals[s].saved_fraction if s in vals else 0 for s in scenarios],
                    width, label=cfg)
        axes[1].bar(xs, [vals[s].mean_ttft_ms if s in vals else 0 for s in scenarios],
                    width, label=cfg)
    for ax, title in zip(axes, ("prefill tokens saved (%)", "mean TTFT (ms)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(scenarios))], scenarios,
                      rotation=30, ha="right")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: Any) -> None:
    """Flags of ``prefixkv bench scenarios``."""
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS),
                   metavar="NAME", help=f"which scenarios (default: all of {list(SCENARIOS)})")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   metavar="CONFIG", help=f"cache configurations (default: {list(CONFIGS)})")
    p.add_argument("--scale", type=int, default=4, help="multiply prompt lengths (default 4)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--policies", nargs="+", default=["lru"], metavar="POLICY",
                   help="eviction policies to compare (default: lru); try with --num-kv-blocks")
    p.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                   help="KV pool size (default: the engine's); small pools force eviction")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG chart")
    p.add_argument("--schedule-policies", nargs="+", default=None, metavar="POLICY",
                   choices=("fcfs", "lpm", "dfs-weight"),
                   help="instead: seed 003's workloads submitted together, these schedule "
                        "policies compared (first = baseline); see prefixkv.bench.scheduling")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (policies; default 3)")
    p.add_argument("--instances", type=int, default=2,
                   help="instances of each workload in the mix (policies; default 2)")


def run_from_args(args: Any) -> int:
    """Run the selected scenarios and configurations; print, and write JSON/PNG if asked."""
    if args.scale < 1:
        raise ValueError("--scale must be >= 1")
    if args.schedule_policies:
        return _run_policies(args)
    from tqdm import tqdm

    kw: dict[str, Any] = {}
    if args.num_kv_blocks is not None:
        kw["num_kv_blocks"] = args.num_kv_blocks
    jobs = [(s, c, p) for s in args.scenarios for c in args.configs
            for p in (args.policies if c != "no-cache" else args.policies[:1])]
    rows = []
    t0 = time.perf_counter()
    for s, c, p in tqdm(jobs, desc="scenarios", unit="run", disable=None):
        rows.append(run_scenario(s, c, scale=args.scale, seed=args.seed,
                                 engine_kwargs={**kw, "eviction_policy": p}))
    print(format_table(rows))
    print(f"({len(rows)} runs in {time.perf_counter() - t0:.1f} s; demo model on "
          "CPU, its text is meaningless)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    if args.plot:
        plot(rows, args.plot)
    return 0


def _run_policies(args: Any) -> int:
    from prefixkv.bench.scheduling import compare
    from prefixkv.bench.scheduling import format_table as policy_table

    blocks = args.num_kv_blocks if args.num_kv_blocks is not None else 96
    rows = compare(list(args.schedule_policies), rounds=args.rounds, num_kv_blocks=blocks,
                   scale=args.scale, seed=args.seed, instances=args.instances,
                   engine_kwargs={"max_num_batched_tokens": 1024})
    print(policy_table(rows))
    print(f"(medians of {args.rounds} interleaved rounds; {blocks} KV blocks of 16 tokens, "
          "1,024-token step budget; demo model on CPU)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0
