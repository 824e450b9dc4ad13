"""prefixkv bench load: many concurrent clients against a running server; latency, failures, leaks.

A bounded load test for operators (and docs/reliability.md): ``--clients`` concurrent clients
send ``--requests`` completions in all, over a shared system prompt plus a unique question;
a share of them stream, and a share of the streams hang up after the first chunk (clients that
go away). Afterwards it waits for the server to go idle and reads its stats: every KV block
must be free or cached (``leaked_blocks`` 0) and none locked. Behind ``prefixkv route`` the
router's stats list every worker's, and the counts are summed over them (``engines``). With
``--pid`` it also reports the server's RSS before and after. Only loopback or your own servers:
it sends real load.

    prefixkv bench load --url http://127.0.0.1:8000 --clients 128 --requests 1000 --pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixkv.wire.fanout import worker_rows


@dataclass(slots=True)
class LoadReport:
    """What one load run saw. Latencies are seconds, per completed (not cut) request."""

    clients: int
    requests: int
    ok: int = 0
    cut_streams: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    p50_s: float = 0.0
    p99_s: float = 0.0
    wall_s: float = 0.0
    rss_before_mb: float | None = None
    rss_after_mb: float | None = None
    leaked_blocks: int = 0
    locked_blocks: int = 0
    engines: int = 0  # engines whose stats were read (a router's workers); 0: none readable
    healthy_after: bool = False
    unreachable_after: str | None = None  # why the server did not answer after the load

    @property
    def num_failures(self) -> int:
        """Requests that got an error or no answer."""
        return sum(self.failures.values())


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of process ``pid`` in MB (Linux ``/proc``), ``None`` if unknown."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def run_load(url: str, *, clients: int, requests: int, max_tokens: int = 8,
                   stream_share: float = 0.25, cut_share: float = 0.5, api_key: str | None = None,
                   pid: int | None = None, seed: int = 0, timeout_s: float = 300.0) -> LoadReport:
    """Run the load (see the module docstring) and return its :class:`LoadReport`."""
    import httpx

    if clients < 1 or requests < 1:
        raise ValueError(f"clients and requests must be >= 1, got {clients}, {requests}")
    rng = random.Random(seed)
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: be brief." for i in range(40))
    plan = [(rng.random() < stream_share, rng.random() < cut_share) for _ in range(requests)]
    report = LoadReport(clients, requests, rss_before_mb=rss_mb(pid))
    latencies: list[float] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    def fail(kind: str) -> None:
        report.failures[kind] = report.failures.get(kind, 0) + 1

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s,
                                 limits=limits) as http:
        async def one(i: int) -> None:
            stream, cut = plan[i]
            body: dict[str, Any] = {"prompt": f"{system}\nQuestion {i}: what is {i} + {i}?",
                                    "max_tokens": max_tokens, "temperature": 0, "stream": stream}
            t0 = time.perf_counter()
            try:
                if not stream:
                    r = await http.post("/v1/completions", json=body)
                    if r.status_code != 200:
                        fail(str(r.status_code))
                        return
                else:
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            fail(str(r.status_code))
                            return
                        async for line in r.aiter_lines():
                            if cut and line.startswith("data: "):
                                report.cut_streams += 1
                                return  # the client goes away mid-stream
                            if line.startswith("data: ") and '"error"' in line:
                                fail("stream_error")
                                return
            except httpx.HTTPError as exc:
                fail(type(exc).__name__)
                return
            report.ok += 1
            latencies.append(time.perf_counter() - t0)

        async def client() -> None:
            while not queue.empty():
                await one(queue.get_nowait())

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        report.wall_s = time.perf_counter() - start
        try:
            await _check_after(http, report)
        except httpx.HTTPError as exc:  # the server went away (or never was there)
            report.unreachable_after = f"{type(exc).__name__}: {exc}"
    report.p50_s, report.p99_s = _quantile(latencies, 0.5), _quantile(latencies, 0.99)
    report.rss_after_mb = rss_mb(pid)
    return report


async def _check_after(http: Any, report: LoadReport) -> None:
    """Wait (up to a minute) until nothing runs or is locked, then sum every engine's leaked
    and locked blocks into ``report`` and ask ``/health``."""
    deadline = time.monotonic() + 60
    while True:  # the server is idle once nothing runs and nothing is locked anywhere
        engines = engine_stats(await http.get("/v1/cache/stats"))
        if all(_idle(e) for e in engines) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    report.engines = len(engines)
    for e in engines:
        report.leaked_blocks += e["num_kv_blocks"] - e["num_free_blocks"] - e["num_cached_blocks"]
        report.locked_blocks += int((e.get("cache") or {}).get("locked_blocks", 0))
    report.healthy_after = (await http.get("/health")).status_code == 200


_ENGINE_KEYS = ("num_running", "num_waiting", "num_kv_blocks", "num_free_blocks",
                "num_cached_blocks")


def engine_stats(resp: Any) -> list[dict[str, Any]]:
    """The engine stats in a ``/v1/cache/stats`` answer: a server's own, or each worker's from
    a router's list (``{"data": [{"worker", "status", "body"}, ...]}``); empty when the answer
    is neither (an error status, another server), so nothing is claimed about its blocks."""
    try:
        payload = resp.json() if resp.status_code == 200 else None
    except ValueError:
        return []
    if not isinstance(payload, dict):
        return []
    rows = worker_rows(payload)
    bodies: list[Any] = [payload] if rows is None else [w["body"] for w in rows]
    engines = [b for b in bodies
               if isinstance(b, dict) and all(isinstance(b.get(k), int) for k in _ENGINE_KEYS)]
    return engines if bodies and len(engines) == len(bodies) else []


def _idle(stats: dict[str, Any]) -> bool:
    return (stats["num_running"] == stats["num_waiting"] == 0
            and not (stats.get("cache") or {}).get("locked_blocks"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``prefixkv bench load``."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--clients", type=int, default=128, help="concurrent clients (default 128)")
    p.add_argument("--requests", type=int, default=1000, help="requests in all (default 1000)")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens per request (default 8)")
    p.add_argument("--stream-share", type=float, default=0.25,
                   help="share of requests that stream (default 0.25)")
    p.add_argument("--cut-share", type=float, default=0.5,
                   help="share of the streams that hang up after the first chunk (default 0.5)")
    p.add_argument("--pid", type=int, default=None, help="server pid, to report its RSS")
    p.add_argument("--api-key", default=None, help="API key, if the server needs one")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``prefixkv bench load``; exit status 1 if a request failed or a block leaked."""
    report = asyncio.run(run_load(args.url, clients=args.clients, requests=args.requests,
                                  max_tokens=args.max_tokens, stream_share=args.stream_share,
                                  cut_share=args.cut_share, api_key=args.api_key, pid=args.pid))
    if args.json:
        print(json.dumps({**asdict(report), "num_failures": report.num_failures}, indent=2))
    else:
        print(f"{report.clients} clients, {report.requests} requests in {report.wall_s:.1f} s: "
              f"{report.ok} ok, {report.cut_streams} streams cut by the client, "
              f"{report.num_failures} failed {report.failures or ''}")
        blocks = (f"leaked blocks {report.leaked_blocks}, locked {report.locked_blocks}"
                  f"{f' over {report.engines} engines' if report.engines > 1 else ''}"
                  if report.engines else
                  f"blocks not checked (the server did not answer: {report.unreachable_after})"
                  if report.unreachable_after else
                  "blocks not checked (no engine stats at /v1/cache/stats)")
        print(f"latency p50 {report.p50_s * 1000:.0f} ms, p99 {report.p99_s * 1000:.0f} ms; "
              f"RSS {report.rss_before_mb} -> {report.rss_after_mb} MB; {blocks}; healthy "
              f"after: {report.healthy_after}")
    bad = report.num_failures or report.leaked_blocks or report.locked_blocks
    return 1 if bad or not report.healthy_after or not report.engines else 0
