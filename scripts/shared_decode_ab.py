"""Shared-prefix decode A/B in one process: SmolLM2-135M decode steps of B sequences whose
block tables start with the same P-token prefix, with the runner's shared-prefix path (the
shipped one) against every sequence gathering its own copy (forced by raising
``_SHARED_MIN_TOKENS``; the shared side runs from 2 sequences, below the shipped 4),
alternating rounds, same tokens and block tables, medians.
Usage (from the repo root):
    PYTHONPATH=. python scripts/shared_decode_ab.py float32 2 2000x8,500x8,2000x2   # dtype, threads, PxB
One thread is timed in thread CPU time, as scripts/runner_ab.py does.
"""
import statistics, sys, time, torch
import prefixkv.runner.attention as att
from prefixkv.models.catalog import ensure_model
from prefixkv.runner.model_runner import ModelRunner, RunItem
dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
clock = time.thread_time if threads == 1 else time.perf_counter
runner = ModelRunner(ensure_model("smollm2-135m-instruct"), threads=threads, dtype=dtype, num_kv_blocks=1300)
configs = sys.argv[3] if len(sys.argv) > 3 else "2000x8,500x8,2000x2"
for P, B in [tuple(map(int, x.split("x"))) for x in configs.split(",")]:
    nb = P // 16
    prefix = list(range(nb))
    runner.execute([RunItem([7] * P, 0, prefix + [nb])])
    tables = [prefix + list(range(200 + 20 * i, 220 + 20 * i)) for i in range(B)]
    runner.execute([RunItem([9 + i] * 16, P, tables[i]) for i in range(B)])
    pos = [P + 16] * B
    def step():
        global pos
        runner.execute([RunItem([5], p, t) for p, t in zip(pos, tables)]); pos = [p + 1 for p in pos]
    step()
    times = {"per-seq gather": [], "shared": []}
    for _ in range(5):
        for mode, lim in (("per-seq gather", 1 << 30), ("shared", 256)):
            att._SHARED_MIN_TOKENS = lim
            att._SHARED_MIN_SEQS = 2  # measure the path below the shipped 4 sequences too
            for _ in range(5):
                t0 = clock(); step(); times[mode].append(clock() - t0)
    att._SHARED_MIN_TOKENS, att._SHARED_MIN_SEQS = 256, 4
    a, b = (statistics.median(times[m]) * 1e3 for m in times)
    print(f"{dtype} threads {threads} prefix {P} batch {B}: gather {a:.1f} ms, shared {b:.1f} ms, speedup {a / b:.2f}x", flush=True)
