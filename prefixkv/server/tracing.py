"""Owns: ``--otlp-traces-endpoint``: one OpenTelemetry span per engine request, exported over OTLP/HTTP.
Imports: prefixkv.engine's outputs and sampling params, tiers/spec.py, cache_metrics.label;
OpenTelemetry's SDK and :mod:`.otlp_json` only inside :func:`install_tracing` (never without the flag).

vLLM's request tracing, with prefixkv's cache figures added. Each engine request (one per prompt
of an HTTP request) that finishes or is aborted becomes one ``llm_request`` span (kind SERVER)
from its arrival to its end, with vLLM's ``gen_ai.*`` attributes (usage, request settings,
latencies) and prefixkv's own:

=========================================  ===================================================
``prefixkv.cached_tokens``                 prompt tokens whose KV was reused (``usage``'s
                                           ``cached_tokens``)
``prefixkv.cached_tokens.pool``            of those, read from the KV pool's prefix cache
``prefixkv.cached_tokens.lower_tiers``     of those, loaded from the host / disk / remote tiers
``prefixkv.cached_tokens.host`` (``disk``,  of those, loaded from each lower tier
``remote``)
``prefixkv.lower_tiers.queried_tokens``    prompt tokens looked up in the lower tiers
``prefixkv.computed_tokens``               prompt tokens computed (prompt less cached)
``prefixkv.tenant``                        the first 12 hex digits of the SHA-256 of the
                                           request's cache salt (as ``/metrics`` labels it;
                                           never the salt), ``default`` without one
``prefixkv.lora``                          the LoRA adapter's name (absent without one)
=========================================  ===================================================

A W3C ``traceparent`` (and ``tracestate``) header on the HTTP request makes the span its child
(:class:`TraceContext`, the ASGI middleware, hands the headers to the request's task). Spans
leave through a ``BatchSpanProcessor`` (the SDK's ``OTEL_BSP_*`` settings apply) and the rest are
flushed when the app shuts down. The SDK's environment conventions hold: ``OTEL_SERVICE_NAME`` /
``OTEL_RESOURCE_ATTRIBUTES`` name the service (``prefixkv`` when they do not),
``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` / ``_TIMEOUT`` reach the exporter. Spans go in OTLP's JSON
encoding (:mod:`prefixkv.server.otlp_json` says why not protobuf).
"""

from __future__ import annotations

import contextvars
import importlib.util
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixkv.engine.outputs import RequestOutput
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.server.cache_metrics import label
from prefixkv.tiers.spec import LOWER_TIERS

EXTRA = "tracing"
"""The optional dependencies' extra: ``pip install "prefixkv[tracing]"``."""

PACKAGES = ("opentelemetry.sdk",)
SPAN_NAME = "llm_request"  # vLLM's
TRACE_HEADERS = (b"traceparent", b"tracestate")
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")

_carrier: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "prefixkv_trace_headers", default=None)


def check_installed() -> None:
    """``RuntimeError`` naming the extra unless the OpenTelemetry SDK and OTLP/HTTP exporter are
    installed (looked up, not imported), so ``prefixkv serve`` fails before loading a model."""
    missing = [name for name in PACKAGES if _find(name) is None]
    if missing:
        raise RuntimeError(
            f"--otlp-traces-endpoint needs OpenTelemetry ({', '.join(missing)} not installed): "
            f"pip install \"prefixkv[{EXTRA}]\"")
    for env in PROTOCOL_ENVS:
        value = os.environ.get(env, "").strip().lower()
        if value and not value.startswith("http/"):  # http/json is what is sent; an
            # http/protobuf receiver's /v1/traces takes JSON too
            raise RuntimeError(f"prefixkv exports traces over OTLP/HTTP only (JSON); "
                               f"${env} is {value!r}")


def _find(name: str) -> object | None:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent missing, or a module blocked in sys.modules
        return None


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """What one engine request's span needs from its start: the tracer, the parent context's
    headers and the request's own attributes. :meth:`end` exports the span."""

    tracer: RequestTracer
    start_ns: int
    carrier: Mapping[str, str] | None
    attributes: dict[str, Any]
    reports_tokens: bool

    def end(self, out: RequestOutput, ttft_s: float | None, e2e_s: float) -> None:
        """Export the span of the request whose last output is ``out`` (finished or aborted):
        ``ttft_s`` / ``e2e_s`` on the server's clock, from the HTTP request's arrival."""
        self.tracer.export(self, out, ttft_s, e2e_s)


class RequestTracer:
    """An OpenTelemetry tracer provider exporting ``llm_request`` spans to one OTLP/HTTP
    endpoint. Built by :func:`install_tracing`; :meth:`shutdown` flushes what is queued."""

    def __init__(self, endpoint: str) -> None:
        check_installed()
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from prefixkv.server.otlp_json import JsonSpanExporter

        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "prefixkv"}))
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(JsonSpanExporter(endpoint)))
        self._tracer = self._provider.get_tracer("prefixkv.server")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER
        self._error = (Status, StatusCode.ERROR)

    def begin(self, request_id: str, params: SamplingParams, *, model: str, cache_salt: str | None,
              lora: str | None, started: float, reports_tokens: bool = True) -> RequestTrace:
        """The trace of an engine request submitted now: ``started`` is the HTTP request's
        arrival on ``time.perf_counter``; the parent is the current request's ``traceparent``;
        ``reports_tokens`` false: its completion tokens count 0 (an echo-only completion)."""
        attributes: dict[str, Any] = {
            "gen_ai.request.id": request_id,
            "gen_ai.response.model": model,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": params.n,
            "prefixkv.tenant": label(cache_salt),
        }
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if lora is not None:
            attributes["prefixkv.lora"] = lora
        start_ns = time.time_ns() - int((time.perf_counter() - started) * 1e9)
        return RequestTrace(self, start_ns, _carrier.get(), attributes, reports_tokens)

    def export(self, trace: RequestTrace, out: RequestOutput, ttft_s: float | None,
               e2e_s: float) -> None:
        """Build and end ``trace``'s span from the request's last output (see
        :meth:`RequestTrace.end`)."""
        attributes = {**trace.attributes, **_usage(out, trace.reports_tokens),
                      **_latencies(out, ttft_s, e2e_s)}
        parent = self._propagator.extract(trace.carrier) if trace.carrier else None
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=self._kind,
                                       attributes=attributes, start_time=trace.start_ns)
        if out.error is not None:
            status, code = self._error
            span.set_status(status(code, out.error))
        span.end(end_time=max(trace.start_ns, trace.start_ns + int(e2e_s * 1e9)))

    def shutdown(self) -> None:
        """Export the spans still queued and stop the exporter (the app's shutdown)."""
        self._provider.shutdown()


def _usage(out: RequestOutput, reports_tokens: bool) -> dict[str, int]:
    prompt = len(out.prompt_token_ids)
    cached = out.num_cached_tokens
    lower = out.num_external_cached_tokens
    completion = sum(len(o.token_ids) for o in out.outputs) if reports_tokens else 0
    by_tier = out.num_external_cached_tokens_by_tier
    return {
        **{f"prefixkv.cached_tokens.{tier}": by_tier.get(tier, 0) for tier in LOWER_TIERS},
        "gen_ai.usage.prompt_tokens": prompt,
        "gen_ai.usage.completion_tokens": completion,
        "gen_ai.usage.num_sequences": len(out.outputs),
        "prefixkv.cached_tokens": cached,
        "prefixkv.cached_tokens.pool": cached - lower,
        "prefixkv.cached_tokens.lower_tiers": lower,
        "prefixkv.lower_tiers.queried_tokens": out.num_external_queried_tokens,
        "prefixkv.computed_tokens": prompt - cached,
    }


def _latencies(out: RequestOutput, ttft_s: float | None, e2e_s: float) -> dict[str, float]:
    """vLLM's ``gen_ai.latency.*``: TTFT and end-to-end on the server's clock (TTFT on the
    engine's when the route does not time it), the phases on the engine's (those reached)."""
    found = {"gen_ai.latency.e2e": e2e_s}
    ttft = ttft_s if ttft_s is not None else out.ttft  # else the engine's (SGLang's route)
    if ttft is not None:
        found["gen_ai.latency.time_to_first_token"] = ttft
    names = {"queue": "time_in_queue", "prefill": "time_in_model_prefill",
             "decode": "time_in_model_decode", "inference": "time_in_model_inference"}
    for phase, seconds in out.metrics.phases().items():
        found[f"gen_ai.latency.{names[phase]}"] = seconds
    return found


Scope = dict[str, Any]


class TraceContext:
    """ASGI middleware: a request's ``traceparent`` / ``tracestate`` headers, kept for its task
    (and the tasks it starts), so :meth:`RequestTracer.begin` makes its spans their children."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope.get("headers", ()) if name in TRACE_HEADERS}
        token = _carrier.set(carrier or None)
        try:
            await self.app(scope, receive, send)
        finally:
            _carrier.reset(token)


def install_tracing(app: Any, endpoint: str | None) -> RequestTracer | None:
    """With ``endpoint`` (``--otlp-traces-endpoint``): the app's :class:`RequestTracer`, its
    :class:`TraceContext` middleware added; ``None`` (and nothing of OpenTelemetry imported)
    without one. ``RuntimeError`` naming the ``tracing`` extra if the packages are missing."""
    if not endpoint:
        return None
    tracer = RequestTracer(endpoint)
    app.add_middleware(TraceContext)
    return tracer
