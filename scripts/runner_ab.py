"""Runner step A/B in one process: two ModelRunners on the same SmolLM2-135M weights, stepped in
alternating rounds (same tokens, same block tables), medians. A side is ``DTYPE[@HINT]``:
the model dtype and the oneDNN pack batch hint (models/cpu_pack.PACK_BATCH_HINT; 0 = no
packing, F.linear). Usage (from the repo root):
    PYTHONPATH=. python scripts/runner_ab.py fp32@8:fp32@64 1      # A:B, threads
    PYTHONPATH=. python scripts/runner_ab.py fp32@0:fp32 2         # F.linear vs packed
Prints the median step time of each side and B's speedup over A for decode batch 1 (context
100 and 2,000), decode batch 8 and a 300-token prefill.
"""
import statistics, sys, time
import torch
import prefixkv.models.cpu_pack as cpu_pack
import prefixkv.models.llama as llama
from prefixkv.models.catalog import ensure_model
from prefixkv.runner.model_runner import ModelRunner, RunItem

threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
path = ensure_model("smollm2-135m-instruct")
def build(spec: str) -> ModelRunner:
    dtype, _, hint = spec.partition("@")
    cpu_pack.PACK_BATCH_HINT = int(hint or 8)
    saved = llama.pack_weight
    if hint == "0":
        llama.pack_weight = lambda *a, **k: None
    try:
        return ModelRunner(path, threads=threads, dtype=dtype, num_kv_blocks=1200)
    finally:
        llama.pack_weight = saved
specs = sys.argv[1].split(":")
A, B = build(specs[0]), build(specs[1])
print("packed weights: A", A.packed_weights, "B", B.packed_weights)
CLOCK = time.thread_time if threads == 1 else time.perf_counter
def steps(r, batch, ctx, n=6):
    if batch > 8:
        items = [RunItem([(7 * i) % 1000 + 3 for i in range(batch)], 0, list(range(0, 300)))]
        t0 = CLOCK(); r.execute(items); return [CLOCK() - t0]
    items = [RunItem([1] * ctx, 0, list(range(b * 140, b * 140 + 140))) for b in range(batch)]
    r.execute(items)
    ts = []
    for s in range(n):
        it = [RunItem([5], ctx + s, x.block_table) for x in items]
        t0 = CLOCK(); r.execute(it); ts.append(CLOCK() - t0)
    return ts
for batch, ctx in [(1, 100), (1, 2000), (8, 100), (300, 0)]:
    a, b = [], []
    for rnd in range(3):
        a += steps(A, batch, ctx); b += steps(B, batch, ctx)
    ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
    print(f"{sys.argv[1]} batch {batch} ctx {ctx}: A {ma:.1f} ms  B {mb:.1f} ms  speedup {ma/mb:.2f}x", flush=True)
