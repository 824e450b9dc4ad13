"""Decode steps through the per-step C path (``runner/cpu_decode.py``) against the module path
(the same C kernels reached through the modules), in one process: one ModelRunner on
SmolLM2-135M-Instruct (float32), ``cpu_decode.ENABLED`` flipped between alternating rounds
(same tokens, same block tables), medians. Usage (from the repo root):
    PYTHONPATH=. python scripts/decode_path_ab.py [threads] [rounds]
Cases: batch 1 at contexts 40 and 2,000, batch 8 at 40.
"""
import statistics, sys, time
from prefixkv.models.catalog import ensure_model
from prefixkv.runner import cpu_decode
from prefixkv.runner.model_runner import ModelRunner, RunItem

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
r = ModelRunner(ensure_model("smollm2-135m-instruct"), threads=threads, dtype="float32",
                num_kv_blocks=1200)
assert r.cpu_decode is not None, "the C decode path does not apply here (not built?)"
bs = r.block_size
for name, batch, ctx in [("b1 ctx 40", 1, 40), ("b1 ctx 2000", 1, 2000), ("b8 ctx 40", 8, 40)]:
    nb = -(-(ctx + 64) // bs)
    tables = [list(range(1 + b * nb, 1 + (b + 1) * nb)) for b in range(batch)]
    r.execute([RunItem([5 + b] * ctx, 0, t) for b, t in enumerate(tables)])
    t: dict[bool, list[float]] = {True: [], False: []}
    for rnd in range(rounds):
        for on in (False, True):
            cpu_decode.ENABLED = on
            for s in range(10):
                items = [RunItem([3], ctx + s, tb) for tb in tables]
                t0 = time.perf_counter(); r.execute(items); t[on].append(time.perf_counter() - t0)
    off, on = statistics.median(t[False]) * 1e3, statistics.median(t[True]) * 1e3
    print(f"{name}: module path {off:.2f} ms  C decode path {on:.2f} ms  speedup {off / on:.2f}x",
          flush=True)
