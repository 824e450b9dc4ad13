"""The endpoint-picker protocol's messages: what the EPP reads from Envoy and what it answers.

The Gateway API Inference Extension's endpoint picker (its proposal 004) speaks Envoy's
``ext_proc`` v3 (``envoy.service.ext_proc.v3.ExternalProcessor/Process``). This module only reads
and builds those protobuf messages; :mod:`prefixkv.router.epp` holds the conversation.

* An endpoint is ``ip:port`` (``[ip6]:port``): :func:`endpoint_of` turns a worker URL into one.
* The picked endpoints, primary first then the fallbacks, go out comma-separated, the same value
  in the ``x-gateway-destination-endpoint`` request header and in the dynamic metadata
  ``envoy.lb`` / ``x-gateway-destination-endpoint`` (the protocol forbids two different values).
* Envoy may restrict the candidates: filter metadata ``envoy.lb.subset_hint`` /
  ``x-gateway-destination-endpoint-subset`` (a list of endpoints; :func:`subset_hint`), and it
  names the endpoint that served a request in ``envoy.lb`` /
  ``x-gateway-destination-endpoint-served`` (:func:`served_endpoint`).
* No eligible endpoint: an ``ImmediateResponse`` 503 (:func:`immediate`), with an OpenAI-style
  error body like the HTTP router's.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from prefixkv.router.errors import error_body

__all__ = ["BODY_CHUNK_BYTES", "DESTINATION", "FULL_DUPLEX", "LB_NAMESPACE", "SERVED_KEY",
           "SUBSET_KEY", "SUBSET_NAMESPACE", "body_echo", "continue_body", "continue_headers",
           "continue_trailers", "endpoint_of", "header_map", "immediate", "routed",
           "served_endpoint", "subset_hint"]

DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
BODY_CHUNK_BYTES = 62000
"""The largest body piece echoed in one message (Envoy takes at most 64 KiB per streamed chunk)."""
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
"""The body mode the Inference Extension configures; assumed when Envoy does not say."""


def endpoint_of(url: str) -> str:
    """A worker URL's ``ip:port`` (the scheme's port when none is given); a host name is
    resolved once, here (``ValueError`` naming the URL when it cannot be)."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        raise ValueError(f"worker URL {url!r} names no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError) as exc:
            raise ValueError(f"worker URL {url!r}: cannot resolve {host!r}: {exc}") from None
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's headers as a dict of lower-case names (``raw_value`` when it is set)."""
    return {h.key.lower(): (h.raw_value.decode("latin-1") if h.raw_value else h.value)
            for h in headers.headers.headers}


def _filter_value(request: pb.ProcessingRequest, namespace: str, key: str) -> struct_pb2.Value | None:
    metadata = request.metadata_context.filter_metadata
    if namespace not in metadata or key not in metadata[namespace].fields:
        return None
    value: struct_pb2.Value = metadata[namespace].fields[key]
    return value


def _endpoints(value: struct_pb2.Value) -> list[str]:
    if value.HasField("list_value"):
        items = [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    else:
        items = value.string_value.split(",")
    return [item.strip() for item in items if item.strip()]


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints Envoy restricts this request to, or ``None`` when it sets no hint (an
    empty set: a hint naming nothing, which leaves no candidate)."""
    value = _filter_value(request, SUBSET_NAMESPACE, SUBSET_KEY)
    return None if value is None else frozenset(_endpoints(value))


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The endpoint Envoy says served the request (it may be a fallback), if it says."""
    value = _filter_value(request, LB_NAMESPACE, SERVED_KEY)
    found = _endpoints(value) if value is not None else []
    return found[0] if found else None


def _mutation(endpoints: Sequence[str], body_length: int | None) -> pb.CommonResponse:
    target = ",".join(endpoints)
    options = [base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION, raw_value=target.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]
    if body_length is not None:
        options.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-length", raw_value=str(body_length).encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD))
    return pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=options))


def _metadata(endpoints: Sequence[str]) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: ",".join(endpoints)}})
    return metadata


def routed(endpoints: Sequence[str], *, in_body: bool,
           body_length: int | None = None) -> pb.ProcessingResponse:
    """The pick: the destination header set (and ``content-length`` when ``body_length`` is
    given) and the ``envoy.lb`` metadata, in a request-headers answer, or (``in_body``: Envoy
    buffered the body and still holds the headers) in the answer to the body's last piece."""
    common = _mutation(endpoints, body_length)
    if in_body:
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                     dynamic_metadata=_metadata(endpoints))
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                 dynamic_metadata=_metadata(endpoints))


def continue_headers(*, request: bool) -> pb.ProcessingResponse:
    """Headers pass unchanged."""
    answer = pb.HeadersResponse()
    return (pb.ProcessingResponse(request_headers=answer) if request
            else pb.ProcessingResponse(response_headers=answer))


def continue_body(*, request: bool) -> pb.ProcessingResponse:
    """A (non full-duplex) body piece passes unchanged."""
    answer = pb.BodyResponse()
    return (pb.ProcessingResponse(request_body=answer) if request
            else pb.ProcessingResponse(response_body=answer))


def continue_trailers(*, request: bool) -> pb.ProcessingResponse:
    """Trailers pass unchanged."""
    answer = pb.TrailersResponse()
    return (pb.ProcessingResponse(request_trailers=answer) if request
            else pb.ProcessingResponse(response_trailers=answer))


def body_echo(body: bytes, end: bool, *, request: bool) -> list[pb.ProcessingResponse]:
    """In full-duplex mode Envoy forwards only what the processor sends back: ``body`` echoed
    in pieces of at most :data:`BODY_CHUNK_BYTES`, the last one carrying ``end``."""
    pieces = [body[i:i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    answers = []
    for i, piece in enumerate(pieces):
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=piece,
                                                      end_of_stream=end and i == len(pieces) - 1)))
        answer = pb.BodyResponse(response=common)
        answers.append(pb.ProcessingResponse(request_body=answer) if request
                       else pb.ProcessingResponse(response_body=answer))
    return answers


def immediate(status: int, message: str, *, code: str, type_: str) -> pb.ProcessingResponse:
    """Answer the client at once with ``status`` and an OpenAI-style error body."""
    content_type = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    body = json.dumps(error_body(message, type_=type_, code=code)).encode()
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=[content_type]), body=body, details=message))
