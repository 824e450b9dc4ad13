"""The C prefill-attention kernel alone against torch SDPA on the same inputs (one layer's
attention; the kernel reads a paged pool through a block table, SDPA gets the gathered
context). Usage (from the repo root):
    PYTHONPATH=. python scripts/cpu_attention_probe.py [dtype]     # float32 (default) | bfloat16
Prints, per shape and thread count, the max difference and both median times.
"""
import sys, time
import torch
import torch.nn.functional as F
from prefixkv.runner import cpu_attention

dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float32
assert cpu_attention.BUILT, "the C kernel is not built here"
torch.manual_seed(0)

def run(heads, kv_heads, d, n, start, bs, threads, scattered=True, reps=7):
    torch.set_num_threads(threads)
    ctx = start + n
    nb = -(-ctx // bs)
    k_cache = torch.randn(2 * nb + 3, bs, kv_heads, d).to(dtype)
    v_cache = torch.randn(2 * nb + 3, bs, kv_heads, d).to(dtype)
    table = torch.randperm(2 * nb + 3)[:nb] if scattered else torch.arange(nb)
    q = torch.randn(n, (heads + 2 * kv_heads) * d).to(dtype)[:, : heads * d].view(n, heads, d)
    out = torch.empty(n, heads, d, dtype=dtype)
    kg = k_cache[table].flatten(0, 1)[:ctx].transpose(0, 1)[None]
    vg = v_cache[table].flatten(0, 1)[:ctx].transpose(0, 1)[None]
    mask = torch.full((n, ctx), float("-inf"), dtype=dtype).triu_(start + 1)
    def mine():
        cpu_attention.prefill(out, q, k_cache, v_cache, table, start)
    def sdpa():
        qs = q.transpose(0, 1)[None]
        if start == 0:
            return F.scaled_dot_product_attention(qs, kg, vg, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(qs, kg, vg, attn_mask=mask, enable_gqa=True)
    mine()
    err = (out.float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
    tm, ts = [], []
    for _ in range(reps):
        t = time.perf_counter(); mine(); tm.append(time.perf_counter() - t)
        t = time.perf_counter(); sdpa(); ts.append(time.perf_counter() - t)
    a, b = sorted(tm)[reps // 2] * 1e3, sorted(ts)[reps // 2] * 1e3
    print(f"{heads}/{kv_heads} heads x {d}, {n} queries on {start} cached, block {bs}, "
          f"{threads} thread(s): max diff {err:.1e}, kernel {a:.2f} ms, SDPA {b:.2f} ms, "
          f"{b / a:.2f}x", flush=True)

for threads in (1, 2):
    run(9, 3, 64, 2030, 0, 16, threads, scattered=False)  # SmolLM2's cold prefill, one layer
    run(9, 3, 64, 30, 2000, 16, threads)  # its warm request
    run(4, 2, 64, 2080, 0, 16, threads, scattered=False)  # the demo model's cold prefill
    run(4, 2, 64, 32, 2048, 16, threads)  # its warm request
