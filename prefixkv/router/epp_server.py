"""Serving the endpoint picker: the gRPC server with Envoy's ``ExternalProcessor``
(:class:`~prefixkv.router.epp.EndpointPicker`) and the gRPC health service, beside the HTTP router
(``prefixkv route --epp``: :func:`serve_beside`) or on a background thread (:class:`EppServer`).

Health. ``grpc.health.v1.Health`` answers ``""`` and ``liveness`` SERVING while the process runs,
``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` SERVING while some worker is
healthy and NOT_SERVING otherwise (re-read every half second).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import grpc
import uvicorn
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from prefixkv.router.config import RouterConfig
from prefixkv.router.epp import EndpointPicker
from prefixkv.router.proxy import Router

__all__ = ["EXT_PROC_SERVICE", "EppServer", "EppService", "serve_beside", "start_epp"]

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_HEALTH_POLL_S = 0.5


@dataclass(slots=True)
class EppService:
    """A running picker: its gRPC server, bound ``port`` and health updater."""

    server: grpc.aio.Server
    port: int
    picker: EndpointPicker
    _health_task: asyncio.Task[None]

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving (streams get ``grace`` seconds) and the health updater."""
        self._health_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._health_task
        await self.server.stop(grace)


async def _track_health(router: Router, health: health_aio.HealthServicer) -> None:
    serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                            health_pb2.HealthCheckResponse.NOT_SERVING)
    for service in ("", "liveness"):
        await health.set(service, serving)
    ready: bool | None = None
    while True:
        now = bool(router.workers.healthy())
        if now != ready:
            ready = now
            for service in ("readiness", EXT_PROC_SERVICE):
                await health.set(service, serving if ready else not_serving)
        await asyncio.sleep(_HEALTH_POLL_S)


async def start_epp(router: Router, host: str, port: int) -> EppService:
    """Serve the picker and the health service on ``host:port`` (0: a free port) over the
    started ``router``, on the running loop; ``RuntimeError`` if the port cannot be bound."""
    server = grpc.aio.server()
    picker = EndpointPicker(router)
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        raise RuntimeError(f"cannot serve the endpoint picker on {host}:{port}: {exc}") from None
    await server.start()
    task = asyncio.get_running_loop().create_task(_track_health(router, health))
    await asyncio.sleep(0)  # the first health statuses are set before anyone asks
    return EppService(server, bound, picker, task)


class EppServer:
    """A router and its picker on a background thread's loop (tests, benchmarks):
    ``with EppServer(config) as epp: ... epp.port ...``; leaving stops both."""

    def __init__(self, config: RouterConfig, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.router = Router(config)
        self.host, self._port = host, port
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._service: EppService | None = None

    def start(self, timeout: float = 30.0) -> Self:
        """Start the router (its first probes) and the picker; errors are raised here."""
        self._thread.start()

        async def up() -> EppService:
            await self.router.start()
            return await start_epp(self.router, self.host, self._port)

        self._service = asyncio.run_coroutine_threadsafe(up(), self._loop).result(timeout)
        self.port = self._service.port
        return self

    def run(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """``fn()`` on the router's loop (its state is the loop's alone)."""
        async def call() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout)

    def stop(self) -> None:
        """Stop the picker and the router, then the loop."""
        service = self._service

        async def down() -> None:
            if service is not None:
                await service.stop()
            await self.router.stop()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(down(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def serve_beside(server: uvicorn.Server, router: Router, host: str, port: int) -> None:
    """``prefixkv route --epp``: the HTTP router ``server`` and, once its lifespan has started
    ``router``, the picker on ``host:port``, on one loop (one policy, one set of in-flight
    counts) until the server exits."""
    http = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if http.done():
            await http  # it failed to start: its error, or its exit
            return
        await asyncio.sleep(0.05)
    service = await start_epp(router, host, port)
    print(f"prefixkv route: endpoint picker (ext_proc gRPC) on {host}:{service.port}", flush=True)
    try:
        await http
    finally:
        await service.stop()
