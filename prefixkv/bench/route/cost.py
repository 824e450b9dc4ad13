"""Routing cost: what the router adds per request, independent of any model.

Starts ``--workers`` instant stub workers (a minimal HTTP/1.1 server, one process each, that
answers every POST with a fixed completion at once) and the router over them (``prefixkv route``,
its own process; optionally a second, baseline router from another checkout, e.g. the previous
commit) and, with ``--peers sglang vllm``, the Rust routers sglang-router and vllm-router from
``--peers-venv`` (cache_aware, the same thresholds; ``scripts/install-router-peers.sh``), then
sends unique ``--prompt-bytes`` prompts:

* at concurrency 1, in interleaved rounds, straight to a stub and through each router: the added
  latency is the router's median minus the direct median of the same round (reported as the
  median over rounds), plus the router process's CPU seconds per request;
* at ``--concurrency`` (default 8), throughput through each router and straight to one stub
  (requests/s; the median of ``--throughput-rounds`` interleaved rounds), sent with httpx or,
  with ``--load-client raw``, the router's own lighter keep-alive client.

With ``--peers``, each router's figures are also given against the first peer's from the same
rounds: ``req_per_s_vs_<peer>`` (median of per-round ratios) and ``added_ms_c1_minus_<peer>``.

Also reports each router's RSS before any traffic and at the end. Run on a quiet machine; only
same-run comparisons mean anything::

    python -m prefixkv.bench.route.cost --prompt-bytes 16384 --baseline-pythonpath /work/main
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

from prefixkv.bench.route.meters import process_threads_cpu
from prefixkv.router.health import wait_until_healthy
from prefixkv.router.local import free_port
from prefixkv.router.upstream import UpstreamPool

_ANSWER = json.dumps({
    "id": "cmpl-stub", "object": "text_completion", "model": "stub",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}).encode()


async def _serve_stub(port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                if head.startswith(b"POST"):
                    status, body = b"200 OK", _ANSWER
                elif head.startswith(b"GET /health"):
                    status, body = b"200 OK", b"{}"
                else:
                    status, body = b"404 Not Found", b"{}"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def _cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` (ns-precise)."""
    return process_threads_cpu(pid) or 0.0


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _prompt(i: int, n: int) -> str:
    head = f"[{i}:{time.monotonic_ns()}] "
    return (head + "lorem ipsum dolor sit amet " * (n // 27 + 1))[:n]


def _start_router(urls: Sequence[str], pythonpath: str | None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ)
    if pythonpath is not None:  # also the working directory: ``-m`` puts it first on sys.path
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixkv.cli", "route", "--port", str(port), "--log-level",
         "warning", "--worker-urls", *urls],
        env=env, cwd=pythonpath, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return proc, f"http://127.0.0.1:{port}"


def _start_peer(name: str, urls: Sequence[str], venv: str) -> tuple[subprocess.Popen[bytes], str]:
    from prefixkv.bench.route.run import build_parser
    from prefixkv.bench.route.peers import router_command

    port = free_port()
    cmd = router_command(name, port, urls, build_parser().parse_args([]), venv)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def _post(client: httpx.Client, url: str, prompt: str) -> float:
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/completions",
                    json={"model": "stub", "prompt": prompt, "max_tokens": 1})
    r.raise_for_status()
    return time.perf_counter() - t0


async def _throughput(url: str, n: int, concurrency: int, prompt_bytes: int,
                      load_client: str = "httpx") -> float:
    if load_client == "raw":
        return await _throughput_raw(url, n, concurrency, prompt_bytes)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as c:
        todo = iter(range(n))

        async def one() -> None:
            for i in todo:
                body = {"model": "stub", "prompt": _prompt(i, prompt_bytes), "max_tokens": 1}
                (await c.post(f"{url}/v1/completions", json=body)).raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        return n / (time.perf_counter() - t0)


async def _throughput_raw(url: str, n: int, concurrency: int, prompt_bytes: int) -> float:
    """As :func:`_throughput` with the router's own keep-alive client (a lighter load
    generator than httpx: on a small machine the client's CPU caps what it can measure)."""
    pool = UpstreamPool(timeout=120)
    todo = iter(range(n))
    headers = {"content-type": "application/json"}

    async def one() -> None:
        for i in todo:
            body = json.dumps({"model": "stub", "prompt": _prompt(i, prompt_bytes),
                               "max_tokens": 1}).encode()
            resp = await pool.post(url, "/v1/completions", body, headers)
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{url} answered {resp.status}")

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one() for _ in range(concurrency)))
    finally:
        pool.close()
    return n / (time.perf_counter() - t0)


def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Start stubs and routers, measure, stop them; returns the figures per router."""
    ports = [free_port() for _ in range(args.workers)]
    stubs = [subprocess.Popen([sys.executable, "-m", "prefixkv.bench.route.cost", "--stub",
                               str(p)]) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    routers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        routers["router"] = _start_router(urls, None)
        if args.baseline_pythonpath:
            routers["baseline"] = _start_router(urls, args.baseline_pythonpath)
        for name in args.peers:
            routers[name] = _start_peer(name, urls, args.peers_venv)

        async def ready() -> None:
            async with httpx.AsyncClient() as c:
                await wait_until_healthy(c, urls + [u for _, u in routers.values()], timeout=120)

        asyncio.run(ready())
        out = {name: {"rss_start_mb": _rss_mb(p.pid)} for name, (p, _) in routers.items()}
        added: dict[str, list[float]] = {name: [] for name in routers}
        cpu = dict.fromkeys(routers, 0.0)
        with httpx.Client(timeout=120) as client:
            for url in [urls[0], *(u for _, u in routers.values())]:  # warm up connections
                for i in range(5):
                    _post(client, url, _prompt(i, args.prompt_bytes))
            order = list(routers)
            for rnd in range(args.rounds):
                direct = [_post(client, urls[0], _prompt(i, args.prompt_bytes))
                          for i in range(args.per_round)]
                k = rnd % len(order)  # the order rotates
                for name in order[k:] + order[:k]:
                    proc, url = routers[name]
                    c0 = _cpu_seconds(proc.pid)
                    lat = [_post(client, url, _prompt(rnd * 1000 + i, args.prompt_bytes))
                           for i in range(args.per_round)]
                    cpu[name] += _cpu_seconds(proc.pid) - c0
                    added[name].append(statistics.median(lat) - statistics.median(direct))
        n = args.rounds * args.per_round
        for name, (proc, url) in routers.items():
            out[name]["added_ms_c1"] = 1000 * statistics.median(added[name])
            out[name]["cpu_ms_per_req"] = 1000 * cpu[name] / n
        # throughput in interleaved rounds (the order rotates), median per router
        targets = {**{name: url for name, (_, url) in routers.items()}, "direct": urls[0]}
        rates: dict[str, list[float]] = {name: [] for name in targets}
        names = list(targets)
        for rnd in range(args.throughput_rounds):
            k = rnd % len(names)
            for name in names[k:] + names[:k]:
                rates[name].append(asyncio.run(_throughput(
                    targets[name], args.throughput_requests, args.concurrency,
                    args.throughput_prompt_bytes, args.load_client)))
        out["direct"] = {}
        for name in names:
            out[name]["req_per_s"] = statistics.median(rates[name])
        for name, (proc, url) in routers.items():
            out[name]["rss_end_mb"] = _rss_mb(proc.pid)
        if args.peers:  # same-round comparisons with the first peer (medians over rounds)
            ref = args.peers[0]
            for name in routers:
                out[name][f"req_per_s_vs_{ref}"] = statistics.median(
                    a / b for a, b in zip(rates[name], rates[ref]))
                out[name][f"added_ms_c1_minus_{ref}"] = 1000 * statistics.median(
                    a - b for a, b in zip(added[name], added[ref]))
        return out
    finally:
        for proc, _ in routers.values():
            proc.terminate()
            proc.wait(timeout=30)
        for s in stubs:
            s.terminate()
            s.wait(timeout=30)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefixkv.bench.route.cost``: prints (and ``--json`` writes) the figures."""
    p = argparse.ArgumentParser(prog="python -m prefixkv.bench.route.cost",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--stub", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prompt-bytes", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--per-round", type=int, default=15)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--throughput-requests", type=int, default=200)
    p.add_argument("--throughput-prompt-bytes", type=int, default=65536)
    p.add_argument("--throughput-rounds", type=int, default=3,
                   help="interleaved throughput rounds of --throughput-requests (median)")
    p.add_argument("--load-client", choices=("httpx", "raw"), default="httpx",
                   help="the throughput rounds' client: httpx, or the router's own keep-alive "
                   "client (lighter: measures faster routers better on a small machine)")
    p.add_argument("--baseline-pythonpath", default=None,
                   help="also run a router from this checkout (PYTHONPATH) beside ours")
    p.add_argument("--peers", nargs="*", default=[], choices=("sglang", "vllm"),
                   help="also run these Rust routers (installed in --peers-venv)")
    p.add_argument("--peers-venv", default="/tmp/routerpeers/venv")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.stub is not None:
        asyncio.run(_serve_stub(args.stub))
        return 0
    out = run(args)
    for name, figures in out.items():
        print(f"{name:<9} " + "  ".join(f"{k} {v:.2f}" for k, v in figures.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
