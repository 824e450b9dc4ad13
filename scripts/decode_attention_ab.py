"""Decode-attention A/B in one process: SmolLM2-135M decode steps with the shipped
``_decode_attention`` (one SDPA call for float32 KV) against the float32-matmul path (two
batched matmuls and a softmax, as before 2026-11-23 and still for other KV dtypes), alternating
rounds, same tokens and block tables, medians. Usage (from the repo root):
    PYTHONPATH=. python scripts/decode_attention_ab.py float32 2     # dtype, threads
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
new = att._decode_attention
def old(d, q, k_cache, v_cache):
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    qd = q if d.rows is None else q[d.rows]
    b = qd.shape[0]
    keys = att._gather(k_cache, d.block_tables).flatten(1, 2)[:, : d.max_len]
    values = att._gather(v_cache, d.block_tables).flatten(1, 2)[:, : d.max_len]
    qg = qd.view(b, kv_heads, heads // kv_heads, dim).float() * (dim**-0.5)
    scores = torch.matmul(qg, keys.float().permute(0, 2, 3, 1))
    if d.keep is not None:
        scores.masked_fill_(~d.keep, float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), values.float().transpose(1, 2))
    return out.view(b, heads, dim).to(q.dtype)
for ctx, batch in ((16, 1), (100, 1), (2000, 1), (16, 8), (500, 8), (2000, 8)):
    items = [RunItem([1] * (ctx + 3 * b), 0, list(range(b * 150, b * 150 + 150))) for b in range(batch)]
    runner.execute(items)
    pos = [[ctx + 3 * b for b in range(batch)]]
    def step():
        runner.execute([RunItem([5], p, x.block_table) for p, x in zip(pos[0], items)]); pos[0] = [p + 1 for p in pos[0]]
    for _ in range(2): step()
    times = {"old": [], "new": []}
    for _ in range(5):
        for mode, fn in (("old", old), ("new", new)):
            att._decode_attention = fn
            for _ in range(5):
                t0 = clock(); step(); times[mode].append(clock() - t0)
    att._decode_attention = new
    o, n = (statistics.median(times[m]) * 1e3 for m in ("old", "new"))
    print(f"{dtype} threads {threads} ctx {ctx} batch {batch}: matmul {o:.2f} ms, sdpa {n:.2f} ms, speedup {o / n:.3f}x", flush=True)
