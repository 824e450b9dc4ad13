"""Benchmark any router on the bench's workload, and prefixkv's beside the Rust routers.

``prefixkv bench route --router-url URL`` replays the workload of :mod:`prefixkv.bench.route.run`
through a router that is already running (ours, sglang-router, vllm-router, anything that
speaks ``/v1/chat/completions``): :func:`run_external`. With ``--worker-urls`` (the workers
behind that router) the workers' caches are reset first and the requests each worker served are
read from their stats (``num_requests_finished``, prefixkv workers), since a foreign router does
not say where it sent a request; with ``--router-pid`` the router process's CPU per request
(its threads and child processes, Linux ``/proc``) and its peak RSS are reported.

``python -m prefixkv.bench.route.peers`` (:func:`main`) is the side by side: it launches the
workers once per workload, then for each of ``--repeats`` rounds starts each router of
``--routers`` over them (its own process, a free port, the same thresholds, order rotated each
round), replays the workload through it and stops it::

    scripts/install-router-peers.sh     # sglang-router, vllm-router in /tmp/routerpeers/venv
    python -m prefixkv.bench.route.peers --routers prefixkv sglang vllm --repeats 3

Routers (:func:`router_command`): ``prefixkv`` (``prefixkv route --policy cache_aware``),
``sglang`` (``sglang-router launch --policy cache_aware``), ``vllm`` (``vllm-router --policy
cache_aware``), all given the bench's ``--cache-threshold``, ``--balance-abs-threshold``,
``--balance-rel-threshold``, ``--max-tree-size`` and ``--eviction-interval``. The Rust routers
are looked up in ``--peers-venv``; a router whose program is missing is an error naming the
install script.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from prefixkv.bench.route.meters import process_cpu, process_rss_mb
from prefixkv.bench.route.replay import PolicyResult, ready, run_external
from prefixkv.bench.route.run import add_arguments
from prefixkv.bench.route.workloads import Workload
from prefixkv.bench.route.report import progress, report

__all__ = ["PEERS_VENV", "ROUTERS", "process_cpu", "process_rss_mb", "router_command",
           "run_external"]

PEERS_VENV = "/tmp/routerpeers/venv"
ROUTERS = ("prefixkv", "sglang", "vllm")
_INSTALL = "scripts/install-router-peers.sh"


def router_command(name: str, port: int, worker_urls: Sequence[str], args: argparse.Namespace,
                   venv: str = PEERS_VENV) -> list[str]:
    """The command line that starts router ``name`` (``ROUTERS``) on ``port`` with cache-aware
    routing and the bench's thresholds; ``ValueError`` for an unknown name or a peer that is
    not installed in ``venv``."""
    same = ["--cache-threshold", str(args.cache_threshold),
            "--balance-abs-threshold", str(args.balance_abs_threshold),
            "--balance-rel-threshold", str(args.balance_rel_threshold),
            "--max-tree-size", str(args.max_tree_size)]
    if name == "prefixkv":
        return [sys.executable, "-m", "prefixkv.cli", "route", "--port", str(port),
                "--log-level", "warning", "--policy", "cache_aware", *same,
                "--eviction-interval", str(args.eviction_interval),
                "--worker-urls", *worker_urls]
    if name not in ROUTERS:
        raise ValueError(f"router must be one of {list(ROUTERS)}, got {name!r}")
    program = Path(venv) / "bin" / ("sglang-router" if name == "sglang" else "vllm-router")
    if not program.exists():
        raise ValueError(f"{program} not found: install the peer routers with {_INSTALL} "
                         f"(or pass --peers-venv)")
    head = [str(program), "launch"] if name == "sglang" else [str(program)]
    from prefixkv.router.local import free_port

    return [*head, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
            "--prometheus-port", str(free_port()), *same,
            "--eviction-interval-secs", str(max(1, round(args.eviction_interval))),
            "--log-level", "warn" if name == "sglang" else "warning",
            "--worker-urls", *worker_urls]


def _one(name: str, urls: Sequence[str], workload: Workload, args: argparse.Namespace,
         workload_name: str) -> PolicyResult:
    from prefixkv.router.local import free_port, stop_processes

    port = free_port()
    proc = subprocess.Popen(router_command(name, port, urls, args, args.peers_venv),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(ready([f"http://127.0.0.1:{port}"]))
        rss0 = process_rss_mb(proc.pid, "VmRSS")
        result = run_external(f"http://127.0.0.1:{port}", name, urls, workload, args,
                              workload_name, pid=proc.pid)
        print(f"  {name}: RSS {rss0 or 0:.0f} MB before traffic", file=sys.stderr)
        return result
    finally:
        stop_processes([proc], timeout=30)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefixkv.bench.route.peers``: the side by side (module docstring)."""
    import shlex

    from prefixkv.bench.route.workloads import resolve, workload_of
    from prefixkv.router.local import LocalWorkers

    p = argparse.ArgumentParser(prog="python -m prefixkv.bench.route.peers",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    add_arguments(p)
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--peers-venv", default=PEERS_VENV)
    args = p.parse_args(argv)
    for name in args.routers:  # fail before any worker starts
        try:
            router_command(name, 0, [], args, args.peers_venv)
        except ValueError as exc:
            p.error(str(exc))
    results: list[PolicyResult] = []
    for wname in args.workloads:
        spec = resolve(wname, args)
        workload = workload_of(spec, args.seed)
        launched = None
        if args.worker_urls:
            urls = list(args.worker_urls)
        else:
            launched = LocalWorkers(args.workers, args.model, shlex.split(spec.worker_args))
            urls = launched.urls
        try:
            asyncio.run(ready(urls))
            for rnd in range(args.repeats):
                k = rnd % len(args.routers)
                for name in args.routers[k:] + args.routers[:k]:
                    results.append(_one(name, urls, workload, args, wname))
                    progress(results[-1])
        finally:
            if launched is not None:
                launched.stop()
    report(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
