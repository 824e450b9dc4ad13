"""What the CPU kernels torch ships can reach on this machine, for SmolLM2-135M's shapes (fp32).

    python scripts/cpu_kernel_probe.py [THREADS]     # default 2

1. Memory read bandwidth (``torch.sum`` and ``torch.dot`` over 540 MB, the model's fp32 weights): the ceiling of
   a batch-1 decode step, which reads every weight once.
2. One decode step's GEMVs (30 layers x qkv / o / gate_up / down, distinct weights so they
   stream from memory, plus the tied 49,152 x 576 output layer) as oneDNN-packed weights
   (what the runner uses), ``x @ W.T`` with ``W.T`` contiguous, and ``F.linear``.
3. Causal prefill attention, one layer (2,030 tokens, 9 query / 3 KV heads, dim 64): SDPA's CPU
   flash kernel on strided views (the runner's call), contiguous inputs, K/V expanded to the
   query heads, and query chunks over a growing context.

Prints milliseconds and the GB/s or GFLOP/s each form reaches (docs/benchmarks.md, issue 16).
"""
import sys
import time

import torch
import torch.nn.functional as F

from prefixkv.models.cpu_pack import pack_weight, packed_linear

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
torch.manual_seed(0)


def timed(f, n):
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n


x = torch.randn(135_000_000)
for name, f in (("torch.sum", x.sum), ("torch.dot", lambda: torch.dot(x, x))):
    runs = sorted(x.numel() * 4 / timed(f, 5) / 1e9 for _ in range(5))
    print(f"read bandwidth, {name}: median {runs[2]:.1f} GB/s, best {runs[-1]:.1f} GB/s")
del x

shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
weights = [torch.randn(o, i) for o, i in shapes]
inputs = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}
nbytes = sum(w.numel() * 4 for w in weights)
forms = {
    "oneDNN packed": lambda w: (lambda x, p=pack_weight(w): packed_linear(x, p, None)),
    "x @ W.T (contiguous)": lambda w: (lambda x, t=w.t().contiguous(): x @ t),
    "F.linear": lambda w: (lambda x, w=w: F.linear(x, w)),
}
for name, make in forms.items():
    calls = [(make(w), inputs[w.shape[1]]) for w in weights]
    dt = timed(lambda: [f(x) for f, x in calls], 10)
    print(f"decode GEMVs, {name:22s} {dt * 1e3:6.1f} ms a step, {nbytes / dt / 1e9:5.1f} GB/s")
    del calls
del weights

T, HQ, HK, D = 2030, 9, 3, 64
q, k, v = torch.randn(T, HQ, D), torch.randn(T, HK, D), torch.randn(T, HK, D)
qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
qc, kc, vc = (t.contiguous() for t in (qs, ks, vs))
flop = HQ * 2 * 2 * (T * T / 2) * D


def chunked(size):
    outs = []
    for s in range(0, T, size):
        e = min(T, s + size)
        mask = None if s == 0 else torch.full((e - s, e), float("-inf")).triu_(s + 1)
        outs.append(F.scaled_dot_product_attention(qc[:, :, s:e], kc[:, :, :e], vc[:, :, :e],
                                                   attn_mask=mask, is_causal=s == 0,
                                                   enable_gqa=True))
    return torch.cat(outs, 2)


attention = {
    "strided views, enable_gqa": lambda: F.scaled_dot_product_attention(
        qs, ks, vs, is_causal=True, enable_gqa=True),
    "contiguous, enable_gqa": lambda: F.scaled_dot_product_attention(
        qc, kc, vc, is_causal=True, enable_gqa=True),
    "K/V expanded to 9 heads": lambda ke=kc.repeat_interleave(3, 1), ve=vc.repeat_interleave(3, 1):
        F.scaled_dot_product_attention(qc, ke, ve, is_causal=True),
    "query chunks of 512": lambda: chunked(512),
}
for name, f in attention.items():
    dt = timed(f, 5)
    print(f"prefill attention, {name:26s} {dt * 1e3:6.1f} ms a layer, {flop / dt / 1e9:5.0f} GFLOP/s")
