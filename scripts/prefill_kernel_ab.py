"""The C prefill-attention kernel against torch SDPA, in one process: one ModelRunner on
SmolLM2-135M-Instruct (DTYPE: float32 or bfloat16), ``cpu_attention.ENABLED`` flipped between alternating rounds
(same tokens, same block tables), medians. Usage (from the repo root):
    PYTHONPATH=. python scripts/prefill_kernel_ab.py [threads] [rounds] [dtype]
Prints both sides' median times and the kernel's speedup for a cold 2,030-token prefill, a
30-token chunk on 2,000 cached tokens (a warm request), and the demo model's cold 2,080-token
prefill and 32-token warm chunk on 2,048 cached tokens.
"""
import statistics, sys, time
import torch
from prefixkv.models.catalog import ensure_model
from prefixkv.models.demo import ensure_demo_model
from prefixkv.runner import cpu_attention
from prefixkv.runner.model_runner import ModelRunner, RunItem

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
assert cpu_attention.BUILT, "the C kernel is not built here"
def cases(runner, prefix, chunk, vocab):
    table = list(range(1, (prefix + chunk) // runner.block_size + 2))
    toks = [(7 * i) % (vocab - 10) + 3 for i in range(prefix + chunk)]
    runner.execute([RunItem(toks[:prefix], 0, table)])  # the cached prefix, written once
    return {
        f"cold {prefix + chunk}": lambda: runner.execute([RunItem(toks, 0, table)]),
        f"warm {chunk} on {prefix}": lambda: runner.execute([RunItem(toks[prefix:], prefix, table)]),
    }
for name, path, prefix, chunk, vocab in [
    ("smollm2", ensure_model("smollm2-135m-instruct"), 2000, 30, 49152),
    ("demo", ensure_demo_model(), 2048, 32, 256),
]:
    r = ModelRunner(path, threads=threads, dtype=dtype, num_kv_blocks=200)
    for case, fn in cases(r, prefix, chunk, vocab).items():
        t = {True: [], False: []}
        reps = 1 if case.startswith("cold") and name == "smollm2" else 5
        for rnd in range(rounds):
            for on in (False, True):
                cpu_attention.ENABLED = on
                for _ in range(reps):
                    t0 = time.perf_counter(); fn(); t[on].append(time.perf_counter() - t0)
        off, on = statistics.median(t[False]) * 1e3, statistics.median(t[True]) * 1e3
        print(f"{name} {dtype} {case}: SDPA {off:.1f} ms  kernel {on:.1f} ms  speedup {off / on:.2f}x", flush=True)
