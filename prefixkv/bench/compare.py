"""``prefixkv benchmark --with-prefix-cache / --without-prefix-cache``: seed 004's comparison.

    prefixkv benchmark                          # both ways, side by side
    prefixkv benchmark --with-prefix-cache      # one way only
    prefixkv benchmark --without-prefix-cache --requests 16 --prefix-len 1024

The same workload both ways: ``--requests`` prompts that share a ``--prefix-len``-token system
prefix, each with its own ``--suffix-len``-token question, ``max_tokens=1`` (so the time is the
TTFT), on two engines with the same model and pool, one with prefix caching and one without.
Requests alternate between the engines (interleaved rounds), so background load hits both
alike; the table reports median TTFT and the prompt tokens each had to prefill.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any


def run_from_args(args: argparse.Namespace) -> int:
    """Run the comparison; print a table (and write ``--json``)."""
    from prefixkv.engine import LLM, SamplingParams

    for name in ("requests", "prefix_len", "suffix_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    both = args.with_prefix_cache == args.without_prefix_cache
    modes = [m for m, on in (("with", args.with_prefix_cache or both),
                             ("without", args.without_prefix_cache or both)) if on]
    rng = random.Random(0)
    prefix = [rng.randrange(32, 127) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(32, 127) for _ in range(args.suffix_len)]
               for _ in range(args.requests)]
    blocks = 4 * -(-(args.prefix_len + args.suffix_len + 1) // 16) + 8  # room for both kinds
    llms = {m: LLM(args.model, enable_prefix_caching=(m == "with"), num_kv_blocks=blocks)
            for m in modes}
    sp = SamplingParams(max_tokens=1, temperature=0)
    ttft: dict[str, list[float]] = {m: [] for m in modes}
    prefill: dict[str, int] = {m: 0 for m in modes}
    for prompt in prompts:  # interleaved rounds: one request per engine per round
        for m in modes:
            t0 = time.perf_counter()
            out = llms[m].generate({"prompt_token_ids": prompt}, sp)[0]
            ttft[m].append(time.perf_counter() - t0)
            prefill[m] += len(prompt) - out.num_cached_tokens
    res: dict[str, Any] = {"requests": args.requests, "prefix_len": args.prefix_len,
                           "suffix_len": args.suffix_len, "runs": {}}
    print(f"{'prefix cache':<14}{'median TTFT ms':>16}{'prefill tokens':>16}")
    for m in modes:
        med = statistics.median(ttft[m]) * 1e3
        res["runs"][m] = {"median_ttft_ms": med, "prefill_tokens": prefill[m]}
        print(f"{m:<14}{med:>16.1f}{prefill[m]:>16}")
    if len(modes) == 2:
        ratio = res["runs"]["without"]["median_ttft_ms"] / max(res["runs"]["with"]["median_ttft_ms"], 1e-9)
        res["ttft_ratio_without_over_with"] = ratio
        print(f"TTFT without / with: {ratio:.1f}x (same run, interleaved)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0
