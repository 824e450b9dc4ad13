"""Runner step A/B: A = the decode attention of commit 91c60d2 with F.linear weights, B = this
tree (packed weights); interleaved rounds, medians. Usage (from the repo root):
    git show 91c60d2:prefixkv/runner/attention.py > /tmp/old_attention.py
    PYTHONPATH=. python scripts/runner_ab.py fp32:bf16 1 [nopack] [packboth]
"""
import sys, time, statistics, torch, importlib.util
from prefixkv.models.catalog import ensure_model
import prefixkv.runner.model_runner as mr
from prefixkv.runner.model_runner import ModelRunner, RunItem
spec = importlib.util.spec_from_file_location("old_attention", "/tmp/old_attention.py")
old = importlib.util.module_from_spec(spec); sys.modules["old_attention"] = old; spec.loader.exec_module(old)
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
torch.set_num_threads(threads)
dtA, dtB = sys.argv[1].split(":")  # e.g. fp32:bf16
path = ensure_model("smollm2-135m-instruct")
A = ModelRunner(path, threads=threads, dtype=dtA, num_kv_blocks=1200)
B = ModelRunner(path, threads=threads, dtype=dtB, num_kv_blocks=1200)
new_attn = mr.PagedAttention
if "nopack" not in sys.argv: print("packed", B.model.pack_weights())
if "packboth" in sys.argv: A.model.pack_weights()
CLOCK = time.thread_time if threads == 1 else time.perf_counter
def use(r): mr.PagedAttention = old.PagedAttention if r is A else new_attn
def steps(r, batch, ctx, n=6):
    use(r)
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
for batch, ctx in [(1, 100), (1, 2000), (8, 100), (512, 0)]:
    a, b = [], []
    for rnd in range(3):
        a += steps(A, batch, ctx); b += steps(B, batch, ctx)
    ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
    print(f"{sys.argv[1]} batch {batch} ctx {ctx}: A {ma:.1f} ms  B {mb:.1f} ms  speedup {ma/mb:.2f}x", flush=True)
