"""Router benchmark: replay scripted sessions through the router under each policy.

Many users, several turns each, one shared system prompt; each turn sends the whole history
(system prompt, earlier user and assistant messages from the script, the new user message) to
``/v1/chat/completions`` through the router, ``concurrency`` sessions at a time. The assistant
turns come from the script, not from the model (the demo model's text is meaningless), so every
policy replays exactly the same prompts.

Workloads (:mod:`prefixkv.bench.route.workloads`): ``chat``, ``shared_prefix`` (a long
document every user shares), ``eviction`` (chat over small KV pools); each launches its own
workers. Policies: every ``--policy`` of ``prefixkv route`` plus ``cache_aware_sim``
(``cache_aware --simulate-eviction``, replaying each worker's eviction policy) and, on request,
``cache_aware_sim_lru`` (the same simulation forced to LRU whatever the workers run).

Per policy it reports the prompt tokens the workers actually computed (``usage.prompt_tokens``
minus ``usage.prompt_tokens_details.cached_tokens``), the cached share, throughput, and the
requests each worker received (max/min), request latency p50/p99, the policy's own CPU per
request (``select``, thread time, microseconds) and the router thread's CPU per request (HTTP
stack included, Linux ``/proc``, milliseconds). Before each policy the workers' caches are emptied
(``POST /v1/cache/reset``, prefixkv workers) so no policy inherits another's cache.

``--router-url URL`` replays the workload through a router already running instead (any router:
see :mod:`prefixkv.bench.route.peers`, which also runs the side by side with the Rust routers).

``python -m prefixkv.bench.route.run --help`` (or ``prefixkv bench route`` where the CLI wires it).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from collections import Counter
from collections.abc import Sequence

from prefixkv.cache import POLICIES as CACHE_POLICIES
from prefixkv.bench.route.meters import CpuMeter, thread_cpu
from prefixkv.bench.route.replay import (
    PolicyResult,
    ready,
    replay,
    reset_caches,
    run_external,
    summarize,
)
from prefixkv.bench.route.report import format_table, plot_results, progress, report
from prefixkv.bench.route.workloads import (
    WORKLOADS,
    Workload,
    make_workload,
    resolve,
    workload_of,
)
from prefixkv.router.policies import POLICY_NAMES

# The web stack (httpx, the router app, worker processes) is imported inside the functions that
# use it, so that building the CLI parser stays fast.

__all__ = ["BENCH_POLICIES", "PolicyResult", "Workload", "format_table", "main",
           "make_workload", "ready", "replay", "reset_caches", "run", "run_policy", "summarize"]

BENCH_POLICIES = (*POLICY_NAMES, "cache_aware_sim", "cache_aware_sim_lru")
_DEFAULT_POLICIES = BENCH_POLICIES[:-1]


def replica_runs(args: argparse.Namespace) -> list[tuple[int, bool]]:
    """(replicas, unshared) per run of a policy, from ``--replicas`` and ``--unshared``."""
    counts = getattr(args, "replicas", [1])
    runs = [(max(1, n), False) for n in counts]
    if getattr(args, "unshared", False):
        runs += [(n, True) for n in counts if n > 1]
    return runs


def run_policy(policy: str, worker_urls: Sequence[str], workload: Workload,
               args: argparse.Namespace, workload_name: str = "chat", *, replicas: int = 1,
               unshared: bool = False) -> PolicyResult:
    """Replay ``workload`` through a fresh router running ``policy`` (a ``BENCH_POLICIES``), or
    through ``args.replicas`` replicas of it that share their decisions (``--peer-urls``),
    taking the requests round robin; the CPU figures are then the first replica's."""
    import contextlib
    import dataclasses

    from prefixkv.router.app import RouterConfig, RouterServer
    from prefixkv.bench.route.disturb import PeriodicResets
    from prefixkv.router.local import free_port

    asyncio.run(reset_caches(worker_urls))
    config = RouterConfig(
        worker_urls=tuple(worker_urls), policy=policy.split("_sim")[0],
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold, balance_window=args.balance_window,
        max_tree_size=args.max_tree_size, chunk_bytes=args.chunk_bytes,
        eviction_interval=args.eviction_interval, seed=args.seed,
        simulate_eviction="_sim" in policy, capacity_tokens=args.capacity_tokens,
        worker_eviction_policy="lru" if policy.endswith("_sim_lru")
        else args.worker_eviction_policy,
        load_factor=args.load_factor, hash_prefix_chunks=args.hash_prefix_chunks,
        health_check_interval=args.health_check_interval,
    )
    ports = [free_port() for _ in range(max(1, replicas))]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(RouterServer(
            dataclasses.replace(config, replica_index=i, peer_urls=() if unshared
                                else tuple(u for u in urls if u != url)), port=port))
            for i, (url, port) in enumerate(zip(urls, ports))]
        server = servers[0]
        meter = CpuMeter(server.router.policy.select)
        setattr(server.router.policy, "select", meter)  # noqa: B010 (mypy: method assignment)
        # one warm-up request is not needed: the first select records the router thread
        t0 = time.perf_counter()
        with PeriodicResets(worker_urls, getattr(args, "reset_every", 0),
                            count=lambda: sum(w.routed for s in servers
                                              for w in s.router.workers.all())):
            usages, per_worker, errors = asyncio.run(replay(
                urls, workload, concurrency=args.concurrency, max_tokens=args.max_tokens,
                model=args.model,
            ))
        seconds = time.perf_counter() - t0
        router_cpu = thread_cpu(meter.native_id)
        reasons: Counter[str] = Counter()
        for metric in (m for s in servers for m in s.router.metrics.requests.collect()):
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    reasons[sample.labels["reason"]] += int(sample.value)
    n = max(1, len(usages))
    if len(urls) > 1:
        policy += f" x{len(urls)}" + (" unshared" if unshared else "")
    return summarize(
        workload_name, policy, usages, per_worker, errors, seconds, reasons=dict(reasons),
        workers=config.worker_urls, policy_cpu_us=meter.seconds / n * 1e6,
        # the router thread's CPU since it started (startup included: an upper bound)
        router_cpu_ms=None if router_cpu is None else router_cpu / n * 1e3,
    )


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags (also used by ``prefixkv bench route``)."""
    p = argparse.ArgumentParser(prog="prefixkv bench route", description=__doc__.split("\n")[0])
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the benchmark's flags to ``p``."""
    p.add_argument("--worker-urls", nargs="+", metavar="URL",
                   help="running workers to use (default: launch --workers local prefixkv workers "
                   "per workload); with --router-url, the workers behind that router")
    p.add_argument("--router-url", default=None, metavar="URL",
                   help="replay through this running router (any kind) instead of prefixkv "
                   "routers started per policy")
    p.add_argument("--router-pid", type=int, default=None, metavar="PID",
                   help="with --router-url: the router's process, for its CPU and RSS")
    p.add_argument("--router-label", default="external", help="with --router-url: its name")
    p.add_argument("--workers", type=int, default=4, help="local workers to launch")
    p.add_argument("--model", default=None, help="model for launched workers (default: demo)")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["chat"],
                   help="chat, shared_prefix (long shared document), eviction (small KV pools)")
    p.add_argument("--worker-args", default=None,
                   help="extra flags for launched workers (default: the workload's, e.g. "
                   "\"--block-size 16 --num-kv-blocks 320\")")
    p.add_argument("--policies", nargs="+", choices=BENCH_POLICIES,
                   default=list(_DEFAULT_POLICIES))
    p.add_argument("--users", type=int, default=None, help="default: the workload's")
    p.add_argument("--turns", type=int, default=None, help="default: the workload's")
    p.add_argument("--concurrency", type=int, default=8, help="sessions replayed at once")
    p.add_argument("--system-words", type=int, default=None)
    p.add_argument("--user-words", type=int, default=None)
    p.add_argument("--assistant-words", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--cache-threshold", type=float, default=0.5)
    p.add_argument("--balance-abs-threshold", type=int, default=32)
    p.add_argument("--balance-rel-threshold", type=float, default=1.5)
    p.add_argument("--balance-window", type=int, default=128)
    p.add_argument("--max-tree-size", type=int, default=2**18)
    p.add_argument("--chunk-bytes", type=int, default=16)
    p.add_argument("--eviction-interval", type=float, default=60.0)
    p.add_argument("--capacity-tokens", type=int, default=None,
                   help="cache_aware_sim: workers' KV capacity (default: from their stats)")
    p.add_argument("--worker-eviction-policy", default=None, choices=sorted(CACHE_POLICIES),
                   help="cache_aware_sim: the policy to replay (default: each worker's, from "
                   "its stats)")
    p.add_argument("--load-factor", type=float, default=1.25, help="consistent_hash")
    p.add_argument("--hash-prefix-chunks", type=int, default=16, help="consistent_hash")
    p.add_argument("--health-check-interval", type=float, default=1.0,
                   help="also how often the workers' cache stats are read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, nargs="+", default=[1], metavar="N",
                   help="run each policy through N router replicas sharing their decisions "
                   "(--peer-urls), the requests sent to them round robin; several counts run "
                   "in turn over the same workers (e.g. 1 4)")
    p.add_argument("--unshared", action="store_true",
                   help="also run each replica count above 1 with replicas that do not share "
                   "(the baseline)")
    p.add_argument("--reset-every", type=int, default=0, metavar="N",
                   help="admin-reset one worker's cache after every N dispatched requests, the "
                   "workers in turn (caches emptied behind the router's back; 0: never)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write computed tokens vs max/min load per policy and workload")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; prints the table (and writes ``--json`` / ``--plot``). Exit code 0."""
    from prefixkv.router.local import LocalWorkers

    results: list[PolicyResult] = []
    for name in args.workloads:
        spec = resolve(name, args)
        workload = workload_of(spec, args.seed)
        launched = None
        if args.router_url:
            results.append(run_external(args.router_url, args.router_label,
                                        args.worker_urls or [], workload, args, name,
                                        pid=args.router_pid))
            continue
        if args.worker_urls:
            urls = list(args.worker_urls)
        else:
            worker_args = shlex.split(spec.worker_args)
            if "precise" in args.policies:  # the precise policy needs the workers' KV events
                from prefixkv.router.local import LAUNCHED_KV_EVENTS

                worker_args += ["--kv-events-config", LAUNCHED_KV_EVENTS]
            launched = LocalWorkers(args.workers, args.model, worker_args)
            urls = launched.urls
        try:
            asyncio.run(ready(urls))
            for policy in args.policies:
                for n, unshared in replica_runs(args):
                    results.append(run_policy(policy, urls, workload, args, name,
                                              replicas=n, unshared=unshared))
                    progress(results[-1])
        finally:
            if launched is not None:
                launched.stop()
    report(results, args.json)
    if args.plot:
        plot_results(results, args.plot)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefixkv.bench.route.run``."""
    return run(build_parser().parse_args(argv))


run_from_args = run  # the name `prefixkv bench route` dispatches to


if __name__ == "__main__":
    sys.exit(main())
