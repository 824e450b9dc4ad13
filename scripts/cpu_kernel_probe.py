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
from functools import partial

import torch
import torch.nn.functional as F

from prefixkv.models.cpu_pack import pack_weight, packed_linear


def timed(f, n):
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n


def bandwidth() -> None:
    x = torch.randn(135_000_000)
    for name, f in (("torch.sum", x.sum), ("torch.dot", partial(torch.dot, x, x))):
        runs = sorted(x.numel() * 4 / timed(f, 5) / 1e9 for _ in range(5))
        print(f"read bandwidth, {name}: median {runs[2]:.1f} GB/s, best {runs[-1]:.1f} GB/s")


def packed(w):
    return partial(packed_linear, packed=pack_weight(w), bias=None)


def colmajor(w):
    t = w.t().contiguous()
    return lambda x: x @ t


def gemvs() -> None:
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    weights = [torch.randn(o, i) for o, i in shapes]
    inputs = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}
    nbytes = sum(w.numel() * 4 for w in weights)
    forms = {"oneDNN packed": packed, "x @ W.T (contiguous)": colmajor,
             "F.linear": lambda w: partial(F.linear, weight=w)}
    for name, make in forms.items():
        calls = [(make(w), inputs[w.shape[1]]) for w in weights]
        dt = timed(lambda calls=calls: [f(x) for f, x in calls], 10)
        print(f"decode GEMVs, {name:22s} {dt * 1e3:6.1f} ms a step, {nbytes / dt / 1e9:5.1f} GB/s")


def attention() -> None:
    T, HQ, HK, D = 2030, 9, 3, 64
    views = [t.transpose(0, 1)[None] for t in (torch.randn(T, HQ, D), torch.randn(T, HK, D),
                                               torch.randn(T, HK, D))]
    qc, kc, vc = (t.contiguous() for t in views)
    ke, ve = kc.repeat_interleave(HQ // HK, 1), vc.repeat_interleave(HQ // HK, 1)
    flop = HQ * 2 * 2 * (T * T / 2) * D

    def chunked(size):
        outs = []
        for s in range(0, T, size):
            e = min(T, s + size)
            mask = None if s == 0 else torch.full((e - s, e), float("-inf")).triu_(s + 1)
            outs.append(F.scaled_dot_product_attention(
                qc[:, :, s:e], kc[:, :, :e], vc[:, :, :e], attn_mask=mask, is_causal=s == 0,
                enable_gqa=True))
        return torch.cat(outs, 2)

    sdpa = partial(F.scaled_dot_product_attention, is_causal=True)
    forms = {
        "strided views, enable_gqa": partial(sdpa, *views, enable_gqa=True),
        "contiguous, enable_gqa": partial(sdpa, qc, kc, vc, enable_gqa=True),
        "K/V expanded to 9 heads": partial(sdpa, qc, ke, ve),
        "query chunks of 512": partial(chunked, 512),
    }
    for name, f in forms.items():
        dt = timed(f, 5)
        print(f"prefill attention, {name:26s} {dt * 1e3:6.1f} ms a layer, "
              f"{flop / dt / 1e9:5.0f} GFLOP/s")


if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    torch.manual_seed(0)
    bandwidth()
    gemvs()
    attention()
