"""Shared-prefix decode A/B in one process: SmolLM2-135M decode steps of B sequences whose
block tables start with the same P-token prefix, with the runner's shared-prefix path (the
shipped one) against every sequence gathering its own copy (forced by raising
``_SHARED_MIN_COPIES``; the shared side runs below the shipped thresholds too, from 2 sequences
and 1 copy: the output says whether the shipped rule takes the path),
alternating rounds, same tokens and block tables, medians.
Usage (from the repo root):
    PYTHONPATH=. python scripts/shared_decode_ab.py float32 2 2000x8,500x8,2000x2   # dtype, threads, PxB
One thread is timed in thread CPU time, as scripts/runner_ab.py does. ``runner_from_args``,
``prefix_decode`` and ``shared_limits`` also serve scripts/shared_flash_ab.py.
"""
import statistics, sys, time
from contextlib import contextmanager
import prefixkv.runner.attention as att
from prefixkv.models.catalog import ensure_model
from prefixkv.runner.model_runner import ModelRunner, RunItem


def runner_from_args(argv, default_configs):
    """``(runner, dtype, threads, clock, [(P, B), ...])`` from ``dtype threads PxB,...``."""
    dtype = argv[1] if len(argv) > 1 else "float32"
    threads = int(argv[2]) if len(argv) > 2 else 2
    clock = time.thread_time if threads == 1 else time.perf_counter
    runner = ModelRunner(ensure_model("smollm2-135m-instruct"), threads=threads, dtype=dtype,
                         num_kv_blocks=1300)
    configs = argv[3] if len(argv) > 3 else default_configs
    return runner, dtype, threads, clock, [tuple(map(int, x.split("x"))) for x in configs.split(",")]


@contextmanager
def shared_limits(copies, seqs=2, tokens=16):
    """Run the block under these shared-path thresholds of the runner; the shipped ones after."""
    shipped = att._SHARED_MIN_COPIES, att._SHARED_MIN_SEQS, att._SHARED_MIN_TOKENS
    att._SHARED_MIN_COPIES, att._SHARED_MIN_SEQS, att._SHARED_MIN_TOKENS = copies, seqs, tokens
    try:
        yield
    finally:
        att._SHARED_MIN_COPIES, att._SHARED_MIN_SEQS, att._SHARED_MIN_TOKENS = shipped


def prefix_decode(runner, P, B):
    """Cache a P-token prefix (blocks 0..), give B sequences a 16-token suffix each in blocks of
    their own, and return ``step()``: one decode step of all B (positions advance). Its
    ``group()`` is the next step's decode group as the runner plans it (``(row, blocks,
    context)``), e.g. for ``attention._shared_blocks``."""
    nb = P // 16
    prefix = list(range(nb))
    runner.execute([RunItem([7] * P, 0, prefix + [nb])])
    tables = [prefix + list(range(200 + 20 * i, 220 + 20 * i)) for i in range(B)]
    runner.execute([RunItem([9 + i] * 16, P, tables[i]) for i in range(B)])
    pos = [P + 16] * B

    def step():
        runner.execute([RunItem([5], p, t) for p, t in zip(pos, tables)])
        pos[:] = [p + 1 for p in pos]

    step.group = lambda: [(i, t, p + 1) for i, (p, t) in enumerate(zip(pos, tables))]
    step()
    return step


if __name__ == "__main__":
    runner, dtype, threads, clock, configs = runner_from_args(sys.argv, "2000x8,500x8,2000x2")
    for P, B in configs:
        step = prefix_decode(runner, P, B)
        shared = att._shared_blocks(step.group(), 16)  # under the shipped thresholds
        copies = (B - 1) * (P // 16) * 16  # the prefix's full blocks are what is shared
        times = {"per-seq gather": [], "shared": []}
        for _ in range(5):
            for mode, lim in (("per-seq gather", 1 << 30), ("shared", 1)):
                with shared_limits(lim):
                    for _ in range(5):
                        t0 = clock(); step(); times[mode].append(clock() - t0)
        a, b = (statistics.median(times[m]) * 1e3 for m in times)
        print(f"{dtype} threads {threads} prefix {P} batch {B} (copies saved {copies}, shipped rule "
              f"{'takes' if shared else 'skips'} it): gather {a:.1f} ms, shared {b:.1f} ms, speedup {a / b:.2f}x", flush=True)
