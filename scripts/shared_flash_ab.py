"""Shared-prefix decode A/B in one process: the shipped shared-prefix attention (one CPU flash
call over the shared keys, read in place when they are one run of blocks) against the float32
matmuls, log-sum-exp and softmax over a gathered copy it replaced (kept below as
``matmul_shared``), in SmolLM2-135M decode steps of B sequences on a P-token shared prefix,
alternating rounds, same tokens and block tables, medians.
Usage (from the repo root):
    PYTHONPATH=. python scripts/shared_flash_ab.py float32 2 2000x8,500x8,2000x4   # dtype, threads, PxB
One thread is timed in thread CPU time, as scripts/runner_ab.py does. The runner's thresholds
for the shared path are lowered while it runs, so both sides take it in every config.
"""
import statistics, sys, torch
import prefixkv.runner.attention as att
from shared_decode_ab import prefix_decode, runner_from_args, shared_limits  # scripts/ is on sys.path


def matmul_shared(d, qd, keys, values, k_cache, v_cache):
    """The replaced shared-prefix path (2026-11-23): gathered float32 copies, matmuls."""
    b, heads, dim = qd.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    qg = qd.view(b, kv_heads, group, dim).float() * (dim**-0.5)
    shared_k = att._gather(k_cache, d.shared).flatten(0, 1).float()
    shared_v = att._gather(v_cache, d.shared).flatten(0, 1).float()
    rows = qg.transpose(0, 1).reshape(kv_heads, b * group, dim)
    s1 = torch.matmul(rows, shared_k.permute(1, 2, 0))
    lse1 = torch.logsumexp(s1, dim=-1)
    o1 = torch.matmul(s1.softmax(dim=-1), shared_v.transpose(0, 1))
    shared = (o1.view(kv_heads, b, group, dim).transpose(0, 1), lse1.view(kv_heads, b, group).transpose(0, 1))
    s2 = att._own_scores(qg, keys, d.keep)
    lse2 = torch.logsumexp(s2, dim=-1)
    o2 = torch.matmul(s2.softmax(dim=-1), values.float().transpose(1, 2))
    return att._merged(shared, (o2, lse2)).reshape(b, heads, dim).to(qd.dtype)


if __name__ == "__main__":
    runner, dtype, threads, clock, configs = runner_from_args(sys.argv, "2000x8,500x8,2000x4")
    shipped = att._decode_shared
    with shared_limits(1):
        for P, B in configs:
            step = prefix_decode(runner, P, B)
            times = {"matmuls": [], "flash": []}
            for r in range(6):
                for mode in (("matmuls", "flash") if r % 2 == 0 else ("flash", "matmuls")):
                    att._decode_shared = matmul_shared if mode == "matmuls" else shipped
                    for _ in range(5):
                        t0 = clock(); step(); times[mode].append(clock() - t0)
            att._decode_shared = shipped
            a, b = (statistics.median(times[m]) * 1e3 for m in times)
            print(f"{dtype} threads {threads} prefix {P} batch {B}: matmuls {a:.1f} ms, flash {b:.1f} ms, speedup {a / b:.2f}x", flush=True)
