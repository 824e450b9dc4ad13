"""Decode stall: the longest wait of a decoding request while a long prompt prefills.

``prefixkv bench stall --budgets 4096 2048``: a request decodes greedily on the demo model;
after 5 of its steps a ``--prompt-tokens`` prompt (4,000) arrives; the gaps between the decoding
request's outputs over the next 12 steps are timed, and the median over ``--repeats`` of the
longest gap is reported per ``max_num_batched_tokens`` budget. Budgets alternate (the machine's
speed drifts), so compare rows of one run. With a 4,096 budget a 4,000-token prefill is one step
(the decode waits for all of it); at 2,048 two. The evidence for ``--max-num-batched-tokens``'s
default (docs/benchmarks.md, "Chunked prefill").
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StallResult", "add_arguments", "longest_gap", "run_from_args"]


@dataclass(frozen=True, slots=True)
class StallResult:
    """One budget's figure: the median (over repeats) of the longest decode gap, in ms."""

    budget: int
    longest_gap_ms: float
    repeats: int


def longest_gap(budget: int, *, prompt_tokens: int = 4000, repeats: int = 3,
                seed: int = 0) -> StallResult:
    """Run the stall scenario on a fresh demo-model engine with step budget ``budget``."""
    if budget < 1 or prompt_tokens < 1 or repeats < 1:
        raise ValueError("budget, prompt_tokens and repeats must be positive")
    from prefixkv.engine.llm import LLM
    from prefixkv.engine.sampling_params import SamplingParams
    from prefixkv.models.demo import ensure_demo_model

    engine = LLM(ensure_demo_model(), block_size=16, max_num_batched_tokens=budget).engine
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(32, 127) for _ in range(n)]

    worst: list[float] = []
    for rep in range(repeats):
        decoding = f"decode-{rep}"
        engine.add_request(tokens(32), SamplingParams(temperature=0.0, max_tokens=400,
                                                      ignore_eos=True), request_id=decoding)
        for _ in range(5):
            engine.step()
        engine.add_request(tokens(prompt_tokens), SamplingParams(temperature=0.0, max_tokens=1),
                           request_id=f"long-{rep}")
        last, gaps = time.perf_counter(), []
        for _ in range(12):
            outs = engine.step()
            now = time.perf_counter()
            if any(o.request_id == decoding for o in outs):
                gaps.append(now - last)
                last = now
        worst.append(max(gaps))
        while engine.has_unfinished_requests():
            engine.step()
    return StallResult(budget, statistics.median(worst) * 1e3, repeats)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``prefixkv bench stall`` flags."""
    p.add_argument("--budgets", type=int, nargs="+", default=[4096, 2048, 4096, 2048],
                   help="max_num_batched_tokens values, run in this order (default: alternating)")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=3)


def run_from_args(args: argparse.Namespace) -> int:
    """Print one line per budget; exit code 0."""
    for budget in args.budgets:
        r = longest_gap(budget, prompt_tokens=args.prompt_tokens, repeats=args.repeats)
        print(f"budget {r.budget}: longest gap of the decoding request {r.longest_gap_ms:.0f} ms "
              f"(median of {r.repeats})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefixkv.bench.stall``."""
    p = argparse.ArgumentParser(prog="prefixkv bench stall", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
