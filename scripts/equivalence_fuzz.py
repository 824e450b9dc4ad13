"""Greedy outputs with prefix caching (random configs, tiers included) vs a no-cache reference.

Each case draws an index (radix / hash), a block size (1, 2, 4, 16), a step budget, a sequence
cap, a pool from barely-enough to large (eviction, preemption), a host and / or disk tier, a
workload of prompts branching from shared roots and from each other, and ``n`` 1 or 2; it runs
the workload three times in shuffled order (a cache reset before the third, sometimes) and
compares every sample's tokens with a no-cache engine's, then checks that every block is free
or cached. A longer, wider sweep than tests/engine/test_prefix_equivalence.py, for runs of
minutes. Usage (from the repo root):
    PYTHONPATH=. python scripts/equivalence_fuzz.py [seed] [seconds]
Prints each mismatch (seed, config, prompt) and a last line ``done N cases, M bad``; exit
status 1 when any case went wrong.
"""
import random, shutil, sys, tempfile, time, traceback
from prefixkv.engine import LLM, SamplingParams
from prefixkv.models.demo import ensure_demo_model


def case(model, reference, rng):
    bs = rng.choice([1, 2, 4, 16])
    cfg = dict(index=rng.choice(["radix", "hash"]), block_size=bs)
    if rng.random() < 0.5:
        cfg["max_num_batched_tokens"] = rng.choice([8, 33, 64, 200])
    if rng.random() < 0.3:
        cfg["max_num_seqs"] = rng.choice([1, 2, 5])
    if rng.random() < 0.4:
        cfg["kv_offload_size"] = rng.choice([8, 64])
    tmp = tempfile.mkdtemp() if rng.random() < 0.3 else None
    if tmp:
        cfg["kv_disk_dir"] = tmp
    roots = [[rng.randrange(256) for _ in range(rng.randrange(1, 90))] for _ in range(rng.randrange(1, 4))]
    prompts = []
    for _ in range(rng.randrange(2, 14)):
        p = list(rng.choice(prompts))[: rng.randrange(1, 200)] if prompts and rng.random() < 0.4 \
            else list(rng.choice(roots))
        prompts.append(p + [rng.randrange(256) for _ in range(rng.randrange(0 if p else 1, 40))])
    max_tokens = rng.choice([1, 3, 8])
    least = -(-(max(map(len, prompts)) + max_tokens) // bs) + 1
    cfg["num_kv_blocks"] = rng.choice([least, least + 3, 2 * least, 4096 // bs])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=rng.choice([1, 1, 2]))
    want = [[c.token_ids for c in o.outputs] for o in reference.generate(prompts, params)]
    problems = []
    try:
        with LLM(model, **cfg) as llm:
            for rnd in range(3):
                order = list(range(len(prompts)))
                rng.shuffle(order)
                outs = llm.generate([prompts[i] for i in order], params)
                for i, o in zip(order, outs):
                    if [c.token_ids for c in o.outputs] != want[i]:
                        problems.append(f"round {rnd} prompt {i} ({len(prompts[i])} tokens)")
                if rnd == 1 and rng.random() < 0.5:
                    llm.reset_prefix_cache()
            s = llm.get_stats()
            if s.num_running or s.num_waiting or s.num_free_blocks + s.num_evictable_blocks != s.num_kv_blocks:
                problems.append(f"blocks: {s.num_free_blocks} free + {s.num_evictable_blocks} "
                                f"evictable of {s.num_kv_blocks}")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return cfg, problems


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    model = ensure_demo_model()
    reference = LLM(model, enable_prefix_caching=False, num_kv_blocks=1024)
    end, n, bad = time.time() + seconds, 0, 0
    while time.time() < end:
        case_seed = seed * 1_000_000 + n
        n += 1
        try:
            cfg, problems = case(model, reference, random.Random(case_seed))
        except Exception:
            cfg, problems = None, [traceback.format_exc()]
        if problems:
            bad += 1
            print(f"seed {case_seed} config {cfg}: " + "; ".join(problems), flush=True)
    print(f"done {n} cases, {bad} bad", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
