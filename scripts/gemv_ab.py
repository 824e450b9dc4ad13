"""Decode steps with the C decode-row matmul (``cpu_gemv``) against oneDNN on the same packed
weights, in one process: one ModelRunner on SmolLM2-135M-Instruct, ``cpu_gemv.ENABLED``
flipped between alternating rounds (same tokens, same block tables), medians. Usage (from the
repo root):
    PYTHONPATH=. python scripts/gemv_ab.py [threads] [rounds]
Cases: batch 1 / 2 / 4 at context 100, batch 1 at 2,000 (float32: the C path is float32 only).
"""
import statistics, sys, time
from prefixkv.models import cpu_gemv
from prefixkv.models.catalog import ensure_model
from prefixkv.runner.model_runner import ModelRunner, RunItem

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
assert cpu_gemv.ENABLED, "the C path is not built (or switched off) here"
r = ModelRunner(ensure_model("smollm2-135m-instruct"), threads=threads, dtype="float32",
                num_kv_blocks=1200)
bs = r.block_size
for name, batch, ctx in [("b1 ctx 100", 1, 100), ("b2 ctx 100", 2, 100), ("b4 ctx 100", 4, 100),
                         ("b1 ctx 2000", 1, 2000)]:
    nb = -(-(ctx + 64) // bs)
    tables = [list(range(1 + b * nb, 1 + (b + 1) * nb)) for b in range(batch)]
    r.execute([RunItem([5 + b] * ctx, 0, t) for b, t in enumerate(tables)])
    t: dict[bool, list[float]] = {True: [], False: []}
    for rnd in range(rounds):
        for on in (False, True):
            cpu_gemv.ENABLED = on
            for s in range(8):
                items = [RunItem([3], ctx + s, tb) for tb in tables]
                t0 = time.perf_counter(); r.execute(items); t[on].append(time.perf_counter() - t0)
    off, on = statistics.median(t[False]) * 1e3, statistics.median(t[True]) * 1e3
    print(f"{name}: oneDNN {off:.2f} ms  C loop {on:.2f} ms  speedup {off / on:.2f}x", flush=True)
