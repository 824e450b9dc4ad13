"""The router's policies as a Gateway API Inference Extension endpoint picker (EPP): the servicer
of Envoy's ``ext_proc`` v3 ``Process`` stream (``prefixkv route --epp``).

Contract. One ``Process`` stream is one HTTP request going through Envoy. The picker reads the
request headers and the whole body (in one message or several), builds the route key as the HTTP
router does (same paths, same keys, ``prompt_cache_key`` hints, the ``precise`` policy's token
ids), asks the router's policy to choose among the healthy workers (narrowed to Envoy's subset
hint when one is given), and answers the chosen endpoint, then the others from least to most
loaded as fallbacks (:mod:`prefixkv.router.epp_protocol`). No candidate left: an
``ImmediateResponse`` 503; a body that is not a JSON object: a 400, as on the HTTP router.

Body modes. Envoy says its mode in ``protocol_config``; without it, full duplex (the Inference
Extension's configuration) is assumed. Full duplex: the headers' answer waits for the body's
end, then the pick rides on it and the body is echoed back (Envoy forwards only what the
processor returns). Buffered (and any other mode): headers and non-final pieces pass at once,
and the pick rides on the answer to the body's last piece (Envoy still holds the headers).

Load. The chosen worker counts the request in flight (the same counters the HTTP router's
policies read) from the pick until the response's end of stream arrives on the same stream, or
the stream ends; if Envoy says a fallback served it, the count moves there. Worker health is the
router's (:class:`~prefixkv.router.proxy.Router`): its ``/health`` probes, and its breakers fed
with what Envoy reports as the HTTP router's dispatches feed them (a worker's 5xx not blamed on
the request, or a pick Envoy had to replace with a fallback, is a failure).

Serving it (gRPC server, health service, ``prefixkv route --epp``): :mod:`prefixkv.router.epp_server`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from prefixkv.router import epp_protocol as msg
from prefixkv.router.app import PROXIED_ROUTES as _KEYS  # the HTTP router's paths and keys: one table
from prefixkv.router.keys import RouteKey, hinted_key
from prefixkv.router.proxy import ERROR_CAUSE_HEADER, Router

__all__ = ["EndpointPicker"]

log = logging.getLogger("prefixkv.router")



def _no_key(body: Any, chunk_bytes: int) -> RouteKey:
    """Paths the HTTP router does not proxy get an empty key (the policy's load rules pick)."""
    return RouteKey(("text", None), ())


@dataclass(slots=True)
class _Exchange:
    """One HTTP request's state on its stream; ``url`` holds one in-flight count until released."""

    request_mode: int = msg.FULL_DUPLEX
    response_mode: int = msg.FULL_DUPLEX
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    subset: frozenset[str] | None = None
    url: str | None = None
    routed: bool = False


class EndpointPicker:
    """The ``ExternalProcessor`` servicer (its one method, ``Process``) over a started :class:`Router` (on the same loop)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.endpoints = {url: msg.endpoint_of(url) for url in router.workers.urls}
        self._worker_at = {ep: url for url, ep in self.endpoints.items()}

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.ProcessingResponse]:
        """Envoy's stream for one HTTP request: answer each message as the module docstring says."""
        ex = _Exchange()
        try:
            async for request in request_iterator:
                answers = await self._step(ex, request)
                for answer in answers:
                    yield answer
                if answers and answers[-1].HasField("immediate_response"):
                    return
        finally:
            self._release(ex)

    async def _step(self, ex: _Exchange, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if request.HasField("protocol_config"):
            ex.request_mode = request.protocol_config.request_body_mode
            ex.response_mode = request.protocol_config.response_body_mode
        hint = msg.subset_hint(request)
        if hint is not None:
            ex.subset = hint
        served = msg.served_endpoint(request)
        if served is not None:
            self._move(ex, served)
        kind = request.WhichOneof("request")
        duplex = ex.request_mode == msg.FULL_DUPLEX
        if kind == "request_headers":
            ex.headers = msg.header_map(request.request_headers)
            if request.request_headers.end_of_stream:  # no body: pick on the headers alone
                return await self._route(ex, body_length=None, in_body=False)
            return [] if duplex else [msg.continue_headers(request=True)]
        if kind == "request_body":
            ex.body += request.request_body.body
            if not request.request_body.end_of_stream:
                return [] if duplex else [msg.continue_body(request=True)]
            if not duplex:
                return await self._route(ex, body_length=None, in_body=True)
            return await self._route(ex, body_length=len(ex.body), in_body=False,
                                     echo=True, end=True)
        if kind == "request_trailers":  # the request ends with trailers, not a body flag
            routed = [] if ex.routed else await self._route(
                ex, body_length=len(ex.body) if duplex else None, in_body=not duplex,
                echo=duplex, end=False)
            if routed and routed[-1].HasField("immediate_response"):
                return routed
            return [*routed, msg.continue_trailers(request=True)]
        response_duplex = ex.response_mode == msg.FULL_DUPLEX
        if kind == "response_headers":
            self._outcome(ex, msg.header_map(request.response_headers))
            if request.response_headers.end_of_stream:
                self._release(ex)
            return [msg.continue_headers(request=False)]
        if kind == "response_body":
            piece = request.response_body
            if piece.end_of_stream:
                self._release(ex)
            return (msg.body_echo(piece.body, piece.end_of_stream, request=False)
                    if response_duplex else [msg.continue_body(request=False)])
        if kind == "response_trailers":
            self._release(ex)
            return [msg.continue_trailers(request=False)]
        return []

    async def _route(self, ex: _Exchange, *, body_length: int | None, in_body: bool,
                     echo: bool = False, end: bool = True) -> list[pb.ProcessingResponse]:
        """Pick for the request read so far; the answers that carry the pick (and the echoed
        body), or one ImmediateResponse."""
        ex.routed = True
        raw = bytes(ex.body)
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError as exc:
            return [msg.immediate(400, f"request body is not valid JSON: {exc}",
                                  code="invalid_json", type_="invalid_request_error")]
        if not isinstance(body, dict):
            return [msg.immediate(400, "request body must be a JSON object", code="invalid_json",
                                  type_="invalid_request_error")]
        try:
            endpoints = await self._pick(ex, body)
        except Exception as exc:  # a bug: this request fails alone
            log.exception("picking an endpoint failed")
            return [msg.immediate(500, f"endpoint picker error: {type(exc).__name__}: {exc}",
                                  code="router_error", type_="internal_error")]
        if not endpoints:
            self.router.metrics.unroutable.inc()
            where = "" if ex.subset is None else " in the subset hint"
            return [msg.immediate(503, f"no ready endpoint{where}", code="no_healthy_worker",
                                  type_="service_unavailable")]
        answers = [msg.routed(endpoints, in_body=in_body, body_length=body_length)]
        if echo:
            answers += msg.body_echo(raw, end, request=True)
        return answers

    async def _pick(self, ex: _Exchange, body: dict[str, Any]) -> list[str]:
        """The chosen endpoint then the fallbacks; empty when no worker is eligible."""
        router, path = self.router, ex.headers.get(":path", "").split("?", 1)[0]
        key = hinted_key(_KEYS.get(path, _no_key), body, router.config.chunk_bytes)
        key = await router.refine_key(path, body, key, ex.headers)
        candidates = router.workers.healthy()
        if ex.subset is not None:
            candidates = [u for u in candidates if self.endpoints[u] in ex.subset]
        if not candidates:
            return []
        loads = router.workers.loads()
        decision = router.policy.select(candidates, loads, key)
        router.metrics.observe_dispatch(decision.url, decision.reason, decision.match_ratio)
        router.workers.begin(decision.url)
        ex.url = decision.url
        rest = sorted((u for u in candidates if u != decision.url), key=lambda u: loads.get(u, 0))
        return [self.endpoints[u] for u in (decision.url, *rest)]

    def _outcome(self, ex: _Exchange, headers: dict[str, str]) -> None:
        """The worker's answer counts for its breaker as on the HTTP router: a 5xx it does not
        blame on the request is a failed dispatch (the router's own accounting: the breaker, an
        immediate probe, the policy told); any other answer is a success."""
        if ex.url is None:
            return
        status = headers.get(":status", "")
        if status.startswith("5") and headers.get(ERROR_CAUSE_HEADER) != "request":
            self.router.dispatch_failed(ex.url, "status_5xx", f"answered {status}")
        else:
            self.router.workers.record_success(ex.url)

    def _move(self, ex: _Exchange, served: str) -> None:
        """Envoy says ``served`` took the request: when that is a fallback, the pick failed
        (Envoy could not connect, or retried its answer), which counts against its breaker, and
        the in-flight count follows."""
        url = self._worker_at.get(served)
        if ex.url is not None and url is not None and url != ex.url:
            self.router.dispatch_failed(ex.url, "connect", f"Envoy served the request from {served}")
            self.router.workers.end(ex.url)
            self.router.workers.begin(url)
            ex.url = url

    def _release(self, ex: _Exchange) -> None:
        if ex.url is not None:
            self.router.workers.end(ex.url)
            ex.url = None
