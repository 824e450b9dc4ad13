"""Decode steps with one of the C paths on and off, in one process: one ModelRunner on
SmolLM2-135M-Instruct, the switch flipped between alternating rounds (same tokens, same block
tables), medians of every step. Usage (from the repo root):
    PYTHONPATH=. python scripts/decode_ab.py SWITCH [threads] [rounds] [dtype]
SWITCH:
    kernel  cpu_attention.DECODES: decodes in the C attention kernel vs the torch path (with it,
            the per-step C decode path too, where it applies);
    gemv    cpu_gemv.ENABLED: the C decode-row matmul vs oneDNN on the same packed weights (in
            float32 the per-step C decode path goes off with it: both effects; bfloat16 has
            the module path only, so there it is the matmul alone);
    path    cpu_decode.ENABLED: the per-step C decode path vs the module path (same kernels).
Cases: batch 1 at contexts 100 / 2,000 / 4,000, batch 8 at 100 (own prompts), batch 8 on one
cached 2,000-token prefix (shared blocks) with 16 own tokens each.
"""
import statistics, sys, time
from prefixkv.models import cpu_gemv
from prefixkv.models.catalog import ensure_model
from prefixkv.runner import cpu_attention, cpu_decode
from prefixkv.runner.model_runner import ModelRunner, RunItem

SWITCHES = {"kernel": (cpu_attention, "DECODES"), "gemv": (cpu_gemv, "ENABLED"),
            "path": (cpu_decode, "ENABLED")}
switch = sys.argv[1] if len(sys.argv) > 1 else ""
if switch not in SWITCHES:
    sys.exit(f"usage: decode_ab.py {{{'|'.join(SWITCHES)}}} [threads] [rounds] [dtype]")
module, flag = SWITCHES[switch]
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
dtype = sys.argv[4] if len(sys.argv) > 4 else "float32"
assert cpu_attention.BUILT, "the C extensions are not built here"
r = ModelRunner(ensure_model("smollm2-135m-instruct"), threads=threads, dtype=dtype,
                num_kv_blocks=2400)
bs = r.block_size

def setup(batch, ctx, shared):
    """Block tables with ``ctx`` tokens written per sequence; shared: one prefix for all."""
    nb = -(-(ctx + 64) // bs)
    if shared:
        prefix = list(range(1, 1 + ctx // bs))
        r.execute([RunItem([9] * (ctx // bs * bs), 0, prefix)])
        tables = [prefix + list(range(1000 + 20 * b, 1020 + 20 * b)) for b in range(batch)]
        start = ctx // bs * bs
        r.execute([RunItem([7 + b] * 16, start, t) for b, t in enumerate(tables)])
        return tables, start + 16
    tables = [list(range(1 + b * nb, 1 + (b + 1) * nb)) for b in range(batch)]
    r.execute([RunItem([5 + b] * ctx, 0, t) for b, t in enumerate(tables)])
    return tables, ctx

for name, batch, ctx, shared in [("b1 ctx 100", 1, 100, False), ("b1 ctx 2000", 1, 2000, False),
                                 ("b1 ctx 4000", 1, 4000, False), ("b8 ctx 100", 8, 100, False),
                                 ("b8 on a shared 2000", 8, 2000, True)]:
    tables, pos = setup(batch, ctx, shared)
    t = {True: [], False: []}
    for rnd in range(rounds):
        for on in (False, True):
            setattr(module, flag, on)
            for s in range(8):
                items = [RunItem([3], pos + s, tb) for tb in tables]
                t0 = time.perf_counter(); r.execute(items); t[on].append(time.perf_counter() - t0)
    off, on = statistics.median(t[False]) * 1e3, statistics.median(t[True]) * 1e3
    print(f"{dtype} {name}: {switch} off {off:.2f} ms  on {on:.2f} ms  speedup {off / on:.2f}x",
          flush=True)
setattr(module, flag, True)
