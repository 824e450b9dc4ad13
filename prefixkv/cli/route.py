"""Owns: ``prefixkv route``: the router's flags and its process (workers launched, EPP beside).
Imports: prefixkv.cache (policy names), prefixkv.router (config, policies, local; the rest lazily).

``prefixkv route``: run the cache-aware router in front of OpenAI-compatible workers.

``prefixkv route --worker-urls URL [URL ...]`` routes to running workers (prefixkv, vLLM,
SGLang); ``prefixkv route --launch N [MODEL]`` first starts N local prefixkv workers
(``prefixkv serve``) on free loopback ports and stops them when the router exits: on SIGINT,
SIGTERM or SIGHUP (after a graceful shutdown), on an error, and (Linux) even when the router is
killed with SIGKILL (the workers ask for SIGTERM when their parent dies).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
from types import FrameType
from typing import Any

from prefixkv.cache import POLICIES as CACHE_POLICIES
from prefixkv.router.config import KEEP_ALIVE_S
from prefixkv.router.local import LAUNCHED_KV_EVENTS
from prefixkv.router.policies import POLICY_NAMES


def register(subparsers: Any) -> None:
    """Add the ``route`` subcommand."""
    p = subparsers.add_parser(
        "route",
        help="cache-aware router over several OpenAI-compatible workers",
        description="Proxy /v1/completions and /v1/chat/completions to several workers, "
        "sending each request where its prefix is most likely cached (SGLang's cache-aware "
        "policy) without letting load pile up.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--worker-urls", nargs="+", metavar="URL",
                     help="base URLs of running workers, e.g. http://127.0.0.1:8001")
    src.add_argument("--launch", nargs="+", metavar=("N", "MODEL"),
                     help="start N local prefixkv workers (optionally serving MODEL) first")
    p.add_argument("--worker-args", default="",
                   help="extra flags for launched workers, e.g. \"--num-kv-blocks 256\"")
    p.add_argument("--policy", choices=POLICY_NAMES, default="cache_aware")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="route to the best-matching worker when its match ratio exceeds this")
    p.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="loads are imbalanced when max - min exceeds this ...")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... and max exceeds min times this; then the least loaded worker wins")
    p.add_argument("--balance-window", type=int, default=128,
                   help="recent dispatches counted for the share test (0: off)")
    p.add_argument("--max-tree-size", type=int, default=2**18,
                   help="prompt bytes each worker's approximate tree is trimmed to")
    p.add_argument("--chunk-bytes", type=int, default=16,
                   help="prompt bytes per route-key chunk (routing granularity)")
    p.add_argument("--eviction-interval", type=float, default=60.0,
                   help="seconds between tree trims (0: trim after every insert)")
    p.add_argument("--simulate-eviction", action="store_true",
                   help="cache_aware: bound each worker's tree by its real KV capacity and "
                   "replay its eviction after every insert (EPP's prefix plugin)")
    p.add_argument("--capacity-tokens", type=int, default=None,
                   help="with --simulate-eviction: each worker's KV capacity in tokens "
                   "(default: read from a prefixkv worker's /v1/cache/stats)")
    p.add_argument("--worker-eviction-policy", default=None, choices=sorted(CACHE_POLICIES),
                   help="with --simulate-eviction: the workers' eviction policy to replay "
                   "(default: each prefixkv worker's, from its stats; else lru)")
    p.add_argument("--load-factor", type=float, default=1.25,
                   help="consistent_hash: no worker takes more than this times the average load")
    p.add_argument("--hash-prefix-chunks", type=int, default=16,
                   help="consistent_hash: leading route-key chunks hashed (16 = 256 bytes)")
    p.add_argument("--hash-replicas", type=int, default=100,
                   help="consistent_hash: virtual nodes per worker on the ring")
    p.add_argument("--kv-events", nargs="+", default=[], metavar="ENDPOINT",
                   help="precise: each worker's KV event stream, in --worker-urls order: auto "
                   "(ask the worker's GET /kv_events; the default), none, "
                   "tcp://HOST:PORT[|tcp://HOST:REPLAY_PORT] (the worker binds), or "
                   "bind:tcp://ADDR:PORT[|...] (the router binds; the worker connects to it)")
    p.add_argument("--kv-events-topic", default="",
                   help="precise: the topic of the given --kv-events endpoints (default '')")
    p.add_argument("--kv-events-rehash", action="store_true",
                   help="precise: the workers' block hashes are not prefixkv's (vLLM workers): "
                   "derive them from each event's tokens and parent")
    p.add_argument("--kv-tier-weights", default="", metavar="TIER=W,...",
                   help="precise: what a cached block is worth by the tier holding it "
                   "(default pool=1,host=0.8,disk=0.25,remote=0.25; any subset)")
    p.add_argument("--peer-urls", nargs="+", default=[], metavar="URL",
                   help="the other router replicas behind the same load balancer: each routing "
                   "decision is shared with them, so N replicas route as one (cache_aware, and "
                   "precise's fallback tree; docs/router.md, Replicas)")
    p.add_argument("--epp", action="store_true",
                   help="also serve the Gateway API Inference Extension's endpoint picker: "
                   "Envoy's ext_proc gRPC on --epp-port, with the same policy and worker health "
                   "(needs the epp extra: pip install 'prefixkv[epp]'; docs/router.md, EPP)")
    p.add_argument("--epp-port", type=int, default=9002,
                   help="with --epp: the picker's gRPC port (default %(default)s, as the "
                   "Inference Extension's)")
    p.add_argument("--replica-index", type=int, default=0, metavar="I",
                   help="with --peer-urls: this replica's position among the replicas (0..N-1, "
                   "e.g. a StatefulSet ordinal): new sessions arriving at several replicas at "
                   "once start on different workers")
    p.add_argument("--health-check-interval", type=float, default=10.0,
                   help="seconds between /health probes of every worker")
    p.add_argument("--health-check-timeout", type=float, default=5.0)
    p.add_argument("--failure-threshold", type=int, default=3,
                   help="failed requests in a row that take a worker out of rotation")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--quarantine-ttl", type=float, default=600.0, metavar="SECONDS",
                   help="how long requests with the same body as one that workers died serving "
                        "are refused (503 request_quarantined; default %(default)s)")
    p.add_argument("--quarantine-size", type=int, default=4096, metavar="N",
                   help="request bodies remembered as suspected of killing workers "
                        "(default %(default)s)")
    p.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S,
                   metavar="SECONDS", help="close a client's idle connection after this long "
                   "(default %(default)s; longer than clients keep theirs)")
    p.add_argument("--admin-api-key", default=os.environ.get("PREFIXKV_ADMIN_API_KEY"),
                   help="the fleet's admin key: needed for the router's /v1/cache/* routes "
                        "(fanned out to every worker) and sent on to the workers (default: "
                        "$PREFIXKV_ADMIN_API_KEY; without one, loopback clients only)")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds to wait for every worker to answer /health at start")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run_route)


def _launch_spec(values: list[str]) -> tuple[int, str | None]:
    if len(values) > 2:
        raise ValueError(f"--launch takes N [MODEL], got {values}")
    try:
        n = int(values[0])
    except ValueError:
        raise ValueError(f"--launch N must be an integer, got {values[0]!r}") from None
    if n <= 0:
        raise ValueError(f"--launch N must be >= 1, got {n}")
    return n, values[1] if len(values) == 2 else None


class _Stop(SystemExit):
    """Raised by the SIGTERM/SIGHUP handler outside uvicorn's own signal handling."""


def run_route(args: argparse.Namespace) -> int:
    """Handler: validate, (launch workers,) wait for them, then serve until a signal."""
    import httpx
    import uvicorn

    from prefixkv.router.app import RouterConfig, create_app
    from prefixkv.router.health import wait_until_healthy
    from prefixkv.router.local import LocalWorkers

    server: uvicorn.Server | None = None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # While serving, SIGHUP asks uvicorn for a graceful exit (uvicorn handles SIGINT and
        # SIGTERM itself and re-raises them when done); otherwise leave through the finally below.
        if server is not None and server.started and not server.should_exit:
            server.should_exit = True
            return
        raise _Stop(128 + signum)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    launched: LocalWorkers | None = None
    try:
        if args.launch is not None:
            n, model = _launch_spec(args.launch)
            worker_args = shlex.split(args.worker_args)
            if args.policy == "precise" and "--kv-events-config" not in worker_args:
                worker_args += ["--kv-events-config", LAUNCHED_KV_EVENTS]
            launched = LocalWorkers(n, model, worker_args, die_with_parent=True)
            urls = launched.urls
        else:
            urls = args.worker_urls
        config = RouterConfig(
            worker_urls=tuple(urls), policy=args.policy, cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold, balance_window=args.balance_window,
            max_tree_size=args.max_tree_size, chunk_bytes=args.chunk_bytes,
            eviction_interval=args.eviction_interval,
            simulate_eviction=args.simulate_eviction, capacity_tokens=args.capacity_tokens,
            worker_eviction_policy=args.worker_eviction_policy,
            load_factor=args.load_factor, hash_prefix_chunks=args.hash_prefix_chunks,
            hash_replicas=args.hash_replicas,
            health_check_interval=args.health_check_interval,
            health_check_timeout=args.health_check_timeout,
            failure_threshold=args.failure_threshold, request_timeout=args.request_timeout,
            timeout_keep_alive=args.timeout_keep_alive,
            quarantine_ttl=args.quarantine_ttl, quarantine_size=args.quarantine_size,
            admin_api_key=args.admin_api_key, kv_events=tuple(args.kv_events),
            kv_events_topic=args.kv_events_topic, kv_events_rehash=args.kv_events_rehash,
            kv_tier_weights=args.kv_tier_weights,
            peer_urls=tuple(args.peer_urls), replica_index=args.replica_index,
            epp_port=args.epp_port if args.epp else None,
        )
        if config.epp_port is not None:
            try:
                from prefixkv.router.epp_server import serve_beside
            except ImportError as exc:  # before waiting on any worker: one line, exit 1
                raise RuntimeError(f"--epp needs the epp extra (pip install 'prefixkv[epp]'): "
                                   f"{exc}") from None

        async def check() -> None:
            async with httpx.AsyncClient() as client:
                await wait_until_healthy(client, config.worker_urls, timeout=args.startup_timeout)

        asyncio.run(check())
        print(f"prefixkv route: {config.policy} over {', '.join(config.worker_urls)} "
              f"on http://{args.host}:{args.port}", flush=True)
        app = create_app(config)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host,
                                               port=args.port, log_level=args.log_level,
                                               timeout_keep_alive=config.timeout_keep_alive))
        if config.epp_port is None:
            server.run()
        else:
            asyncio.run(serve_beside(server, app.router, args.host, config.epp_port))
    except _Stop as stop:
        return int(stop.code or 0)
    finally:
        if launched is not None:
            launched.stop()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 0
