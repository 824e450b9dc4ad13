"""The fused C elementwise steps (models/_cpu_ops.c) against torch's ops, in one process: one
ModelRunner on SmolLM2-135M-Instruct (fp32), ``cpu_ops.ENABLED`` flipped between alternating
rounds (same tokens, same block tables), medians. Usage (from the repo root):
    PYTHONPATH=. python scripts/cpu_ops_ab.py [threads] [rounds]
Cases: a cold 2,030-token prefill, 30 tokens on 2,000 cached, decode batch 1 at context 100,
decode batch 8 at context 100; then the demo model's cold 2,080 and warm 32-token requests.
"""
import statistics, sys, time
from prefixkv.models import cpu_ops
from prefixkv.models.catalog import ensure_model
from prefixkv.models.demo import ensure_demo_model
from prefixkv.runner.model_runner import ModelRunner, RunItem

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
assert cpu_ops.BUILT, "the C ops are not built here"
for name, path, vocab, prefix, chunk in [
    ("smollm2", ensure_model("smollm2-135m-instruct"), 49152, 2000, 30),
    ("demo", ensure_demo_model(), 256, 2048, 32),
]:
    r = ModelRunner(path, threads=threads, dtype="float32", num_kv_blocks=400)
    toks = [(7 * i) % (vocab - 10) + 3 for i in range(prefix + chunk)]
    table = list(range(1, 140))
    r.execute([RunItem(toks[:prefix], 0, table)])
    tables8 = [list(range(150 + 10 * b, 160 + 10 * b)) for b in range(8)]
    r.execute([RunItem([5 + b] * 100, 0, t) for b, t in enumerate(tables8)])
    cases = {
        f"cold {prefix + chunk}": (1, lambda: r.execute([RunItem(toks, 0, table)])),
        f"warm {chunk} on {prefix}": (5, lambda: r.execute([RunItem(toks[prefix:], prefix, table)])),
        "decode b1 ctx 100": (8, lambda: r.execute([RunItem([3], 100, tables8[0])])),
        "decode b8 ctx 100": (8, lambda: r.execute([RunItem([3], 100, t) for t in tables8])),
    }
    for case, (reps, fn) in cases.items():
        t = {True: [], False: []}
        for rnd in range(rounds):
            for on in (False, True):
                cpu_ops.ENABLED = on
                for _ in range(reps):
                    t0 = time.perf_counter(); fn(); t[on].append(time.perf_counter() - t0)
        off, on = statistics.median(t[False]) * 1e3, statistics.median(t[True]) * 1e3
        print(f"{name} {case}: torch ops {off:.2f} ms  fused {on:.2f} ms  speedup {off / on:.2f}x",
              flush=True)
