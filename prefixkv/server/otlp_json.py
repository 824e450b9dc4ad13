"""Owns: the OTLP/HTTP span exporter of ``--otlp-traces-endpoint``, in OTLP's JSON encoding.
Imports: httpx and OpenTelemetry's SDK (only through :mod:`prefixkv.server.tracing`, with the flag).

Why not the SDK's ``opentelemetry-exporter-otlp-proto-http``: it needs ``opentelemetry-proto``'s
generated modules, and ``xds-protos`` (the endpoint picker's Envoy protos, the ``epp`` extra)
ships an old copy of the same files (``opentelemetry/proto/...``) that overwrites them when it is
installed after, so ``prefixkv[epp,tracing]`` could not export at all (``ImportError:
InstrumentationScope``). OTLP/HTTP with ``Content-Type: application/json`` is part of the OTLP
spec (ids in hex, enums as numbers, 64-bit integers as strings) and every OTLP receiver takes it
(the OpenTelemetry Collector, Jaeger, Tempo). ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` /
``OTEL_EXPORTER_OTLP_HEADERS`` and ``..._TIMEOUT`` (seconds, default 10) apply; a failed post
drops that batch (the SDK's processor logs it) and never reaches a request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

log = logging.getLogger("prefixkv.server")

__all__ = ["JsonSpanExporter", "encode_spans"]


def _value(v: Any) -> dict[str, Any]:
    """An OTLP ``AnyValue``."""
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return {"stringValue": str(v)}


def _attributes(attrs: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in (attrs or {}).items()]


def _span(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None  # an ended SDK span always has one
    out: dict[str, Any] = {
        "traceId": f"{ctx.trace_id:032x}",
        "spanId": f"{ctx.span_id:016x}",
        "name": span.name,
        "kind": span.kind.value + 1,  # OTLP counts SPAN_KIND_UNSPECIFIED as 0
        "startTimeUnixNano": str(span.start_time or 0),
        "endTimeUnixNano": str(span.end_time or 0),
        "attributes": _attributes(span.attributes),
        "status": {"code": span.status.status_code.value,
                   **({"message": span.status.description} if span.status.description else {})},
    }
    if span.parent is not None:
        out["parentSpanId"] = f"{span.parent.span_id:016x}"
    if ctx.trace_state:
        out["traceState"] = ctx.trace_state.to_header()
    return out


def encode_spans(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """An ``ExportTraceServiceRequest`` in OTLP's JSON encoding, spans grouped by resource and
    instrumentation scope."""
    by_resource: dict[int, tuple[Any, dict[tuple[str, str], list[dict[str, Any]]]]] = {}
    for span in spans:
        _, scopes = by_resource.setdefault(id(span.resource), (span.resource, {}))
        scope = span.instrumentation_scope
        key = (scope.name, scope.version or "") if scope is not None else ("", "")
        scopes.setdefault(key, []).append(_span(span))
    return {"resourceSpans": [
        {"resource": {"attributes": _attributes(resource.attributes)},
         "scopeSpans": [{"scope": {"name": name, **({"version": version} if version else {})},
                         "spans": rows} for (name, version), rows in scopes.items()]}
        for resource, scopes in by_resource.values()]}


class JsonSpanExporter(SpanExporter):
    """Posts batches of ended spans to ``endpoint`` (the full ``.../v1/traces`` URL)."""

    def __init__(self, endpoint: str) -> None:
        headers = parse_env_headers(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
                                    or os.environ.get("OTEL_EXPORTER_OTLP_HEADERS") or "",
                                    liberal=True)
        timeout = float(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
                        or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT") or 10.0)
        self.endpoint = endpoint
        self._client = httpx.Client(timeout=timeout,
                                    headers={**headers, "content-type": "application/json"})

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Post one batch; ``FAILURE`` (logged once per batch) when the receiver is down or
        refuses it."""
        try:
            resp = self._client.post(self.endpoint, json=encode_spans(spans))
        except httpx.HTTPError as exc:
            log.warning("OTLP export to %s failed: %r", self.endpoint, exc)
            return SpanExportResult.FAILURE
        if resp.status_code >= 300:
            log.warning("OTLP export to %s refused: %s %s", self.endpoint, resp.status_code,
                        resp.text[:200])
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Close the HTTP client."""
        self._client.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered here (the batch processor holds the queue)."""
        return True
