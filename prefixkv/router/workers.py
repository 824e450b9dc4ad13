"""Worker registry (health, load counters), health probes, and local worker processes.

A worker is any OpenAI-compatible server (prefixkv, vLLM, SGLang) reachable at a base URL that
answers ``GET /health`` with a 2xx. The registry is the router's only record of workers; it is
used from the router's event loop only (no locking).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Self
from urllib.parse import urlsplit

import httpx


def normalize_worker_url(url: str) -> str:
    """``http(s)://host[:port][/path]`` without a trailing slash; ``ValueError`` otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"bad worker URL {url!r}: expected http://HOST:PORT or https://HOST:PORT")
    try:
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise ValueError(f"bad worker URL {url!r}: {exc}") from None
    if parts.query or parts.fragment:
        raise ValueError(f"bad worker URL {url!r}: no query or fragment allowed")
    return url.strip().rstrip("/")


@dataclass(slots=True)
class Worker:
    """One worker's state as the router sees it.

    ``in_flight`` counts requests dispatched and not yet finished (the load the policies use);
    ``routed`` counts dispatches; ``failures`` counts failed dispatches and failed probes.
    """

    url: str
    healthy: bool = True
    in_flight: int = 0
    routed: int = 0
    failures: int = 0
    last_error: str | None = None


class WorkerRegistry:
    """The workers, in the order given; URLs are normalized and must be distinct."""

    def __init__(self, urls: Iterable[str]) -> None:
        normalized = [normalize_worker_url(u) for u in urls]
        if not normalized:
            raise ValueError("worker_urls must name at least one worker")
        if len(set(normalized)) != len(normalized):
            raise ValueError(f"worker_urls has duplicates: {normalized}")
        self._workers = {u: Worker(u) for u in normalized}

    @property
    def urls(self) -> list[str]:
        """All worker URLs, healthy or not."""
        return list(self._workers)

    def __getitem__(self, url: str) -> Worker:
        return self._workers[url]

    def all(self) -> list[Worker]:
        """Every worker record (live objects)."""
        return list(self._workers.values())

    def healthy(self, exclude: Iterable[str] = ()) -> list[str]:
        """URLs of healthy workers not in ``exclude``, in registry order."""
        skip = set(exclude)
        return [u for u, w in self._workers.items() if w.healthy and u not in skip]

    def loads(self) -> dict[str, int]:
        """In-flight requests per worker."""
        return {u: w.in_flight for u, w in self._workers.items()}

    def begin(self, url: str) -> None:
        """A request was dispatched to ``url``."""
        w = self._workers[url]
        w.in_flight += 1
        w.routed += 1

    def end(self, url: str) -> None:
        """A request dispatched to ``url`` finished (successfully or not)."""
        self._workers[url].in_flight -= 1

    def mark_down(self, url: str, error: str) -> bool:
        """Take ``url`` out of rotation; True if it was healthy until now."""
        w = self._workers[url]
        w.failures += 1
        w.last_error = error
        was = w.healthy
        w.healthy = False
        return was

    def mark_up(self, url: str) -> bool:
        """Put ``url`` back in rotation; True if it was unhealthy until now."""
        w = self._workers[url]
        was = w.healthy
        w.healthy = True
        return not was


async def probe(client: httpx.AsyncClient, url: str, timeout: float) -> str | None:
    """``GET url/health``: ``None`` when it answers 2xx in time, else the reason."""
    try:
        resp = await client.get(f"{url}/health", timeout=timeout)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if resp.status_code >= 300:
        return f"GET /health answered {resp.status_code}"
    return None


@dataclass(frozen=True, slots=True)
class WorkerCacheStats:
    """What a prefixkv worker's ``GET /v1/cache/stats`` says about its real cache."""

    capacity_tokens: int  # num_kv_blocks * block_size
    cached_blocks: int
    prompt_tokens: int  # prompt tokens it has processed since it started


async def fetch_cache_stats(
    client: httpx.AsyncClient, url: str, timeout: float
) -> WorkerCacheStats | None:
    """The worker's cache figures, or ``None`` when it has no such endpoint (vLLM, SGLang),
    does not answer, or answers something else."""
    try:
        resp = await client.get(f"{url}/v1/cache/stats", timeout=timeout)
        d = resp.json()
    except (httpx.HTTPError, ValueError):
        return None
    if resp.status_code != 200 or not isinstance(d, dict):
        return None
    try:
        return WorkerCacheStats(
            capacity_tokens=int(d["num_kv_blocks"]) * int(d["block_size"]),
            cached_blocks=int(d["num_cached_blocks"]),
            prompt_tokens=int(d["num_prompt_tokens"]),
        )
    except (TypeError, KeyError, ValueError):
        return None


async def wait_until_healthy(
    client: httpx.AsyncClient, urls: Sequence[str], *, timeout: float, poll: float = 0.25
) -> None:
    """Wait until every URL answers ``/health``; ``RuntimeError`` naming those that did not."""
    deadline = time.monotonic() + timeout
    pending = list(urls)
    errors: dict[str, str] = {}
    while True:
        results = await asyncio.gather(*(probe(client, u, min(timeout, 5.0)) for u in pending))
        errors = {u: e for u, e in zip(pending, results) if e is not None}
        pending = list(errors)
        if not pending or time.monotonic() >= deadline:
            break
        await asyncio.sleep(poll)
    if pending:
        detail = "; ".join(f"{u}: {e}" for u, e in errors.items())
        raise RuntimeError(f"worker(s) not healthy after {timeout:g}s: {detail}")


async def health_loop(
    registry: WorkerRegistry,
    client: httpx.AsyncClient,
    *,
    interval: float,
    timeout: float,
    on_change: Callable[[str, bool], None],
) -> None:
    """Probe every worker each ``interval`` seconds, forever; ``on_change(url, healthy)`` on
    each transition (a worker that fails leaves the rotation, and returns once it answers)."""
    while True:
        await asyncio.sleep(interval)
        urls = registry.urls
        results = await asyncio.gather(*(probe(client, u, timeout) for u in urls))
        for url, error in zip(urls, results):
            changed = registry.mark_up(url) if error is None else registry.mark_down(url, error)
            if changed:
                on_change(url, error is None)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalWorkers:
    """``n`` prefixkv servers started as subprocesses on free loopback ports.

    ``python -m prefixkv.cli serve [MODEL] --host 127.0.0.1 --port P *extra_args``. The object
    owns the processes: :meth:`stop` (or leaving the ``with`` block) terminates them all.
    """

    def __init__(
        self,
        n: int,
        model: str | None = None,
        extra_args: Sequence[str] = (),
        *,
        host: str = "127.0.0.1",
        log_dir: str | None = None,
    ) -> None:
        if n <= 0:
            raise ValueError(f"n must be >= 1, got {n!r}")
        self.urls: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self._commands: list[list[str]] = []
        self._log_dir = log_dir
        for _ in range(n):
            port = free_port(host)
            cmd = [sys.executable, "-m", "prefixkv.cli", "serve"]
            cmd += [model] if model else []
            cmd += ["--host", host, "--port", str(port), *extra_args]
            self._commands.append(cmd)
            self.urls.append(f"http://{host}:{port}")
            self.procs.append(self._spawn(len(self._commands) - 1))

    def _spawn(self, i: int) -> subprocess.Popen[bytes]:
        if self._log_dir is None:
            return subprocess.Popen(
                self._commands[i], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
        with open(os.path.join(self._log_dir, f"worker{i}.log"), "ab") as log:
            return subprocess.Popen(self._commands[i], stdout=log, stderr=subprocess.STDOUT)

    def restart(self, i: int) -> None:
        """Start worker ``i`` again (same command and port) after it died or was killed."""
        if self.procs[i].poll() is None:
            raise ValueError(f"worker {i} is still running")
        self.procs[i] = self._spawn(i)

    def stop(self) -> None:
        """Terminate every worker and wait for it (kill after 10 s)."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
