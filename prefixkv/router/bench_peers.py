"""Benchmark any router on the bench's workload, and prefixkv's beside the Rust routers.

``prefixkv bench route --router-url URL`` replays the workload of :mod:`prefixkv.router.bench`
through a router that is already running (ours, sglang-router, vllm-router, anything that
speaks ``/v1/chat/completions``): :func:`run_external`. With ``--worker-urls`` (the workers
behind that router) the workers' caches are reset first and the requests each worker served are
read from their stats (``num_requests_finished``, prefixkv workers), since a foreign router does
not say where it sent a request; with ``--router-pid`` the router process's CPU per request
(its threads and child processes, Linux ``/proc``) and its peak RSS are reported.

``python -m prefixkv.router.bench_peers`` (:func:`main`) is the side by side: it launches the
workers once per workload, then for each of ``--repeats`` rounds starts each router of
``--routers`` over them (its own process, a free port, the same thresholds, order rotated each
round), replays the workload through it and stops it::

    scripts/install-router-peers.sh     # sglang-router, vllm-router in /tmp/routerpeers/venv
    python -m prefixkv.router.bench_peers --routers prefixkv sglang vllm --repeats 3

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
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from prefixkv.router.bench import PolicyResult, Workload, add_arguments, replay, summarize
from prefixkv.router.bench_meters import process_threads_cpu
from prefixkv.router.bench_report import progress, report

__all__ = ["PEERS_VENV", "ROUTERS", "process_cpu", "process_rss_mb", "router_command",
           "run_external"]

PEERS_VENV = "/tmp/routerpeers/venv"
ROUTERS = ("prefixkv", "sglang", "vllm")
_INSTALL = "scripts/install-router-peers.sh"


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def process_cpu(pid: int) -> float | None:
    """CPU seconds (all live threads, ns-precise) of ``pid`` and its child processes; ``None``
    when ``pid`` is gone or ``/proc`` is missing."""
    total, found = 0.0, False
    for p in _descendants(pid) if os.path.isdir("/proc") else []:
        cpu = process_threads_cpu(p)
        if cpu is not None:
            found = True
            total += cpu
    return total if found else None


def process_rss_mb(pid: int, field: str = "VmHWM") -> float | None:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of ``pid`` and its child processes, in MB."""
    total, found = 0.0, False
    for p in _descendants(pid) if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        total += int(line.split()[1]) / 1024
                        found = True
        except OSError:
            continue
    return total if found else None


async def _finished(urls: Sequence[str]) -> dict[str, int | None]:
    """Each prefixkv worker's ``num_requests_finished`` (``None`` when it does not say)."""
    import httpx

    out: dict[str, int | None] = {}
    async with httpx.AsyncClient(timeout=30.0) as client:
        for u in urls:
            try:
                out[u] = int((await client.get(f"{u}/v1/cache/stats")).json()
                             ["num_requests_finished"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                out[u] = None
    return out


async def _served_model(url: str) -> str | None:
    """The first model id a worker lists (Rust routers need ``model`` in the body)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            return str((await client.get(f"{url}/v1/models")).json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def run_external(url: str, label: str, worker_urls: Sequence[str], workload: Workload,
                 args: argparse.Namespace, workload_name: str = "chat",
                 pid: int | None = None) -> PolicyResult:
    """Replay ``workload`` through the router at ``url`` (reported as policy ``label``)."""
    from prefixkv.router.bench import reset_caches

    url = url.rstrip("/")
    model = args.model
    if worker_urls:
        asyncio.run(reset_caches(worker_urls))
        model = asyncio.run(_served_model(worker_urls[0])) or model
    before = asyncio.run(_finished(worker_urls))
    cpu0 = None if pid is None else process_cpu(pid)
    t0 = time.perf_counter()
    usages, per_worker, errors = asyncio.run(replay(
        url, workload, concurrency=args.concurrency, max_tokens=args.max_tokens, model=model))
    seconds = time.perf_counter() - t0
    cpu1 = None if pid is None else process_cpu(pid)
    if not per_worker and worker_urls:  # a foreign router: count at the workers
        after = asyncio.run(_finished(worker_urls))
        per_worker.update({u: (after[u] or 0) - (before[u] or 0) for u in worker_urls
                           if after[u] is not None and before[u] is not None})
    n = max(1, len(usages))
    return summarize(
        workload_name, label, usages, per_worker, errors, seconds, reasons={},
        workers=list(worker_urls) or sorted(per_worker), policy_cpu_us=0.0,
        router_cpu_ms=None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / n * 1e3,
        rss_mb=None if pid is None else process_rss_mb(pid),
    )


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
    from prefixkv.router.bench import ready
    from prefixkv.router.local import free_port

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
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefixkv.router.bench_peers``: the side by side (module docstring)."""
    import shlex

    from prefixkv.router.bench import ready
    from prefixkv.router.bench_workloads import resolve, workload_of
    from prefixkv.router.local import LocalWorkers

    p = argparse.ArgumentParser(prog="python -m prefixkv.router.bench_peers",
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
