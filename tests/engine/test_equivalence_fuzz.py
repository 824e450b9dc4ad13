"""Greedy outputs with prefix caching (random configs, tiers included) equal a no-cache engine's.

Each case draws an index (radix / hash), a block size (1, 2, 4, 16), a step budget, a sequence
cap, a pool from barely-enough to large (eviction, preemption), a host and / or disk tier, a
workload of prompts branching from shared roots and from each other, and ``n`` 1 or 2; it runs
the workload three times in shuffled order (a cache reset before the third, sometimes), compares
every sample's tokens with a no-cache engine's, then checks that every block is free or cached.
A wider sweep than ``test_prefix_equivalence.py``: ``PREFIXKV_FUZZ_CASES=500`` (and
``PREFIXKV_FUZZ_SEED``) runs it for minutes; the default suite runs a few seeded cases.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from prefixkv.engine import LLM, SamplingParams
from prefixkv.models.demo import ensure_demo_model

CASES = int(os.environ.get("PREFIXKV_FUZZ_CASES", "16"))
SEED = int(os.environ.get("PREFIXKV_FUZZ_SEED", "0"))


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(ensure_demo_model(), enable_prefix_caching=False, num_kv_blocks=1024)


@pytest.mark.parametrize("case", range(CASES))
def test_cached_outputs_equal_uncached_outputs(case: int, reference: LLM, tmp_path: Path) -> None:
    rng = random.Random(SEED * 1_000_000 + case)
    bs = rng.choice([1, 2, 4, 16])
    cfg: dict[str, Any] = {"index": rng.choice(["radix", "hash"]), "block_size": bs}
    if rng.random() < 0.5:
        cfg["max_num_batched_tokens"] = rng.choice([8, 33, 64, 200])
    if rng.random() < 0.3:
        cfg["max_num_seqs"] = rng.choice([1, 2, 5])
    if rng.random() < 0.4:
        cfg["kv_offload_size"] = rng.choice([8, 64])
    if rng.random() < 0.3:
        cfg["kv_disk_dir"] = str(tmp_path)
    roots = [[rng.randrange(256) for _ in range(rng.randrange(1, 90))]
             for _ in range(rng.randrange(1, 4))]
    prompts: list[list[int]] = []
    for _ in range(rng.randrange(2, 14)):
        p = (list(rng.choice(prompts))[: rng.randrange(1, 200)]
             if prompts and rng.random() < 0.4 else list(rng.choice(roots)))
        prompts.append(p + [rng.randrange(256) for _ in range(rng.randrange(0 if p else 1, 40))])
    max_tokens = rng.choice([1, 3, 8])
    least = -(-(max(map(len, prompts)) + max_tokens) // bs) + 1
    cfg["num_kv_blocks"] = rng.choice([least, least + 3, 2 * least, 4096 // bs])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            n=rng.choice([1, 1, 2]))
    want = [[c.token_ids for c in o.outputs] for o in reference.generate(prompts, params)]
    with LLM(ensure_demo_model(), **cfg) as llm:
        for rnd in range(3):
            order = list(range(len(prompts)))
            rng.shuffle(order)
            outs = llm.generate([prompts[i] for i in order], params)
            got = {i: [c.token_ids for c in o.outputs] for i, o in zip(order, outs)}
            bad = [i for i in order if got[i] != want[i]]
            assert not bad, f"config {cfg}, round {rnd}: prompts {bad} differ"
            if rnd == 1 and rng.random() < 0.5:
                llm.reset_prefix_cache()
        s = llm.get_stats()
    assert (s.num_running, s.num_waiting) == (0, 0)
    assert s.num_free_blocks + s.num_evictable_blocks == s.num_kv_blocks, cfg
