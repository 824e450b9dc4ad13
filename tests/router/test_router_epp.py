"""The endpoint picker (``prefixkv route --epp``) in the conversation Envoy holds with it.

No Envoy binary runs here: :class:`Envoy` plays its part with a gRPC client built from the same
``ext_proc`` v3 protos, step by step as the Inference Extension's protocol (proposal 004) says,
against the real picker over loopback and small stdlib HTTP workers (``/health`` and POST), which
the picker's router probes for real; a stopped worker is a closed socket.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixkv.router.config import RouterConfig
from prefixkv.router.epp_server import EXT_PROC_SERVICE, EppServer
from prefixkv.router.epp_protocol import BODY_CHUNK_BYTES, DESTINATION, endpoint_of
from prefixkv.router.local import free_port

MODES = processing_mode_pb2.ProcessingMode


class Worker(ThreadingHTTPServer):
    """A worker answering ``GET /health`` and any POST with its own port; ``stop()`` closes it."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.port = self.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoint = f"127.0.0.1:{self.port}"
        self.connections: list[socket.socket] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections.append(request)
        super().process_request(request, client_address)

    def stop(self) -> None:
        """As a killed worker: no new connection, and the open ones (keep-alive) drop."""
        self.shutdown()
        self.server_close()
        for conn in self.connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Worker

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send({"status": "ok"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send({"worker": self.server.port})


class Envoy:
    """One ext_proc stream, as Envoy drives it for one HTTP request: ``send`` a message,
    ``answer`` the picker's next reply (``queue.Empty`` when none comes in time)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._out: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        self._in: queue.Queue[pb.ProcessingResponse | Exception] = queue.Queue()
        self._call = pb_grpc.ExternalProcessorStub(channel).Process(iter(self._out.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for answer in self._call:
                self._in.put(answer)
        except grpc.RpcError as exc:
            self._in.put(exc)

    def send(self, **fields: object) -> None:
        self._out.put(pb.ProcessingRequest(**fields))

    def answer(self, timeout: float = 5.0) -> pb.ProcessingResponse:
        got = self._in.get(timeout=timeout)
        if isinstance(got, Exception):
            raise got
        return got

    def close(self) -> None:
        self._out.put(None)

    def cancel(self) -> None:
        self._call.cancel()


def headers(path: str = "/v1/completions", *, end: bool = False) -> pb.HttpHeaders:
    pairs = {":method": "POST", ":path": path, ":authority": "gateway",
             "content-type": "application/json"}
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=end)


def protocol(request_mode: int, response_mode: int = MODES.NONE) -> pb.ProtocolConfiguration:
    return pb.ProtocolConfiguration(request_body_mode=request_mode,  # type: ignore[arg-type]
                                    response_body_mode=response_mode)  # type: ignore[arg-type]


def metadata(namespace: str, key: str, value: object) -> base_pb2.Metadata:
    fields = struct_pb2.Struct()
    fields.update({key: value})
    return base_pb2.Metadata(filter_metadata={namespace: fields})


def destination(answer: pb.ProcessingResponse, where: str) -> list[str]:
    """The endpoints the picker answered in the header mutation of ``where`` (which must agree
    with the ``envoy.lb`` dynamic metadata)."""
    common = getattr(answer, where).response
    header = {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}
    meta = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value
    assert header[DESTINATION] == meta
    return meta.split(",")


def body(prompt: str) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()


def wait_for(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    ws = [Worker() for _ in range(3)]
    yield ws
    for w in ws:
        if w.socket.fileno() != -1:
            w.stop()


def picker(workers: list[Worker], **settings: object) -> EppServer:
    config = RouterConfig(worker_urls=tuple(w.url for w in workers), health_check_interval=0.1,
                          health_check_timeout=1.0, **settings)  # type: ignore[arg-type]
    return EppServer(config)


def in_flight(epp: EppServer) -> dict[str, int]:
    return epp.run(epp.router.workers.loads)  # type: ignore[no-any-return]


def test_buffered_headers_then_body_in_one_message(workers: list[Worker]) -> None:
    with picker(workers) as epp, grpc.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
        envoy = Envoy(channel)
        envoy.send(request_headers=headers(), protocol_config=protocol(MODES.BUFFERED))
        first = envoy.answer()
        assert first.HasField("request_headers")  # the headers pass; Envoy holds them
        assert not first.request_headers.response.header_mutation.set_headers
        raw = body("hello " * 100)
        envoy.send(request_body=pb.HttpBody(body=raw, end_of_stream=True))
        picked = destination(envoy.answer(), "request_body")
        assert sorted(picked) == sorted(w.endpoint for w in workers)  # primary, then fallbacks
        url = next(w.url for w in workers if w.endpoint == picked[0])
        assert in_flight(epp)[url] == 1
        # Envoy sends the request there, then tells the picker about the response
        assert httpx.post(f"http://{picked[0]}/v1/completions", content=raw).json() == {
            "worker": int(picked[0].rsplit(":", 1)[1])}
        envoy.send(response_headers=pb.HttpHeaders(end_of_stream=False))
        assert envoy.answer().HasField("response_headers")
        assert in_flight(epp)[url] == 1  # the response is still running
        envoy.send(response_body=pb.HttpBody(body=b"{}", end_of_stream=True))
        assert envoy.answer().HasField("response_body")
        assert in_flight(epp)[url] == 0
        envoy.close()


def test_full_duplex_body_split_over_several_messages(workers: list[Worker]) -> None:
    prompt = "You are a careful assistant. " * 6000  # 174 KB: three echoed pieces
    raw = body(prompt)
    with picker(workers) as epp, grpc.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
        choices = []
        for _ in range(3):  # no protocol_config: full duplex, as the Inference Extension runs
            envoy = Envoy(channel)
            envoy.send(request_headers=headers())
            with pytest.raises(queue.Empty):  # the headers' answer waits for the body
                envoy.answer(timeout=0.3)
            cuts = [0, 1000, 70000, len(raw)]
            for a, b in zip(cuts, cuts[1:]):
                envoy.send(request_body=pb.HttpBody(body=raw[a:b], end_of_stream=b == len(raw)))
            first = envoy.answer()
            picked = destination(first, "request_headers")
            lengths = {o.header.key: o.header.raw_value
                       for o in first.request_headers.response.header_mutation.set_headers}
            assert lengths["content-length"] == str(len(raw)).encode()
            echoed, ends = b"", []
            while not ends or not ends[-1]:
                part = envoy.answer().request_body.response.body_mutation.streamed_response
                assert len(part.body) <= BODY_CHUNK_BYTES
                echoed += part.body
                ends.append(part.end_of_stream)
            assert echoed == raw and len(ends) == 3  # Envoy forwards exactly the body it sent
            choices.append(picked[0])
            envoy.send(response_headers=pb.HttpHeaders(end_of_stream=True))
            assert envoy.answer().HasField("response_headers")
            envoy.close()
        assert len(set(choices)) == 1  # cache_aware: the prefix stays where it is cached
        wait_for(lambda: sum(in_flight(epp).values()) == 0)


def test_fallback_list_follows_load_and_served_endpoint_takes_the_count(
        workers: list[Worker]) -> None:
    with picker(workers, policy="least_load") as epp, \
            grpc.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
        held = []
        for _ in range(2):  # two requests in flight on two workers
            envoy = Envoy(channel)
            envoy.send(request_headers=headers(), protocol_config=protocol(MODES.BUFFERED))
            envoy.answer()
            envoy.send(request_body=pb.HttpBody(body=body("x"), end_of_stream=True))
            held.append((envoy, destination(envoy.answer(), "request_body")))
        busy = {held[0][1][0], held[1][1][0]}
        assert len(busy) == 2
        envoy = Envoy(channel)
        envoy.send(request_headers=headers(), protocol_config=protocol(MODES.BUFFERED))
        envoy.answer()
        envoy.send(request_body=pb.HttpBody(body=body("y"), end_of_stream=True))
        picked = destination(envoy.answer(), "request_body")
        assert picked[0] not in busy and set(picked[1:]) == busy  # idle first, then the rest
        # Envoy's retry went down the list: the first fallback served it
        envoy.send(response_headers=pb.HttpHeaders(), metadata_context=metadata(
            "envoy.lb", "x-gateway-destination-endpoint-served", picked[1]))
        envoy.answer()
        loads = {endpoint_of(u): n for u, n in in_flight(epp).items()}
        assert loads[picked[0]] == 0 and loads[picked[1]] == 2
        envoy.close()  # the stream ends without a response end: the count is released
        wait_for(lambda: {endpoint_of(u): n for u, n in in_flight(epp).items()}[picked[1]] == 1)
        for other, _ in held:
            other.cancel()  # Envoy resets the streams: their counts are released too
        wait_for(lambda: sum(in_flight(epp).values()) == 0)


def _pick(channel: grpc.Channel, **extra: object) -> pb.ProcessingResponse:
    envoy = Envoy(channel)
    envoy.send(request_headers=headers(), protocol_config=protocol(MODES.BUFFERED), **extra)
    envoy.answer()
    envoy.send(request_body=pb.HttpBody(body=body("pick me"), end_of_stream=True))
    answer = envoy.answer()
    envoy.close()
    return answer


def _check(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status  # type: ignore[no-any-return]


def test_a_stopped_worker_is_never_picked_and_none_ready_is_a_503(workers: list[Worker]) -> None:
    with picker(workers, policy="round_robin") as epp, \
            grpc.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
        serving = health_pb2.HealthCheckResponse.SERVING
        assert {_check(channel, s) for s in ("", "liveness", "readiness", EXT_PROC_SERVICE)} == {
            serving}
        workers[1].stop()
        wait_for(lambda: workers[1].url not in epp.run(epp.router.workers.healthy))
        for _ in range(6):
            picked = destination(_pick(channel), "request_body")
            assert workers[1].endpoint not in picked and len(picked) == 2
        workers[0].stop()
        workers[2].stop()
        wait_for(lambda: not epp.run(epp.router.workers.healthy))
        answer = _pick(channel)
        assert answer.immediate_response.status.code == 503
        assert json.loads(answer.immediate_response.body)["error"]["code"] == "no_healthy_worker"
        wait_for(lambda: _check(channel, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _check(channel, "liveness") == serving
        assert sum(in_flight(epp).values()) == 0


def _answered(channel: grpc.Channel, status: str, only: Worker,
              blame: str | None = None) -> list[str]:
    """One request restricted to ``only`` whose response Envoy reports as ``status``."""
    envoy = Envoy(channel)
    envoy.send(request_headers=headers(), protocol_config=protocol(MODES.BUFFERED),
               metadata_context=metadata("envoy.lb.subset_hint",
                                         "x-gateway-destination-endpoint-subset", [only.endpoint]))
    envoy.answer()
    envoy.send(request_body=pb.HttpBody(body=body("fail me"), end_of_stream=True))
    answer = envoy.answer()
    if answer.HasField("immediate_response"):
        envoy.close()
        return []
    pairs = {":status": status, **({"x-prefixkv-error-cause": blame} if blame else {})}
    envoy.send(response_headers=pb.HttpHeaders(end_of_stream=True, headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])))
    envoy.answer()
    envoy.close()
    return destination(answer, "request_body")


def test_worker_5xx_reported_by_envoy_open_its_breaker_as_on_the_http_router(
        workers: list[Worker]) -> None:
    # probes every 30 s: only the reported answers can take the worker out of rotation
    config = RouterConfig(worker_urls=tuple(w.url for w in workers), health_check_interval=30,
                          failure_threshold=3)
    bad = workers[0]
    with EppServer(config) as epp, grpc.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
        for _ in range(5):  # blamed on the request: passed through, never the worker's fault
            assert _answered(channel, "500", bad, blame="request") == [bad.endpoint]
        assert _answered(channel, "200", bad) == [bad.endpoint]
        for _ in range(3):
            assert _answered(channel, "503", bad) == [bad.endpoint]
        assert bad.url not in epp.run(epp.router.workers.healthy)
        assert _answered(channel, "200", bad) == []  # the hint's only worker is out: a 503
        for _ in range(4):
            assert bad.endpoint not in destination(_pick(channel), "request_body")


def test_subset_hint_restricts_the_candidates(workers: list[Worker]) -> None:
    hint = "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"
    with picker(workers) as epp, grpc.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
        for _ in range(3):
            answer = _pick(channel, metadata_context=metadata(*hint, [workers[2].endpoint]))
            assert destination(answer, "request_body") == [workers[2].endpoint]
        two = [workers[0].endpoint, workers[1].endpoint]
        assert sorted(destination(_pick(channel, metadata_context=metadata(*hint, two)),
                                  "request_body")) == sorted(two)
        as_text = f"{workers[1].endpoint}, {workers[2].endpoint}"  # the hint as one string
        assert sorted(destination(_pick(channel, metadata_context=metadata(*hint, as_text)),
                                  "request_body")) == sorted([workers[1].endpoint,
                                                              workers[2].endpoint])
        for nothing in ([], ["10.0.0.1:8000"]):  # empty, or no endpoint the picker knows
            answer = _pick(channel, metadata_context=metadata(*hint, nothing))
            assert answer.immediate_response.status.code == 503
        wait_for(lambda: sum(in_flight(epp).values()) == 0)


def test_bad_bodies_are_400s_and_a_bodiless_request_is_picked_on_its_headers(
        workers: list[Worker]) -> None:
    with picker(workers) as epp, grpc.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
        for raw in (b"{not json", b"[1, 2]"):
            envoy = Envoy(channel)
            envoy.send(request_headers=headers())
            envoy.send(request_body=pb.HttpBody(body=raw, end_of_stream=True))
            answer = envoy.answer()
            assert answer.immediate_response.status.code == 400
            assert json.loads(answer.immediate_response.body)["error"]["code"] == "invalid_json"
            envoy.close()
        envoy = Envoy(channel)
        envoy.send(request_headers=headers("/v1/models", end=True))
        assert len(destination(envoy.answer(), "request_headers")) == 3
        envoy.close()
        wait_for(lambda: sum(in_flight(epp).values()) == 0)


def test_config_refuses_a_bad_epp_port() -> None:
    with pytest.raises(ValueError, match="epp_port"):
        RouterConfig(worker_urls=("http://127.0.0.1:1",), epp_port=70000)


def test_prefixkv_route_epp_serves_the_picker_beside_the_http_router(
        workers: list[Worker]) -> None:
    port, epp_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixkv.cli", "route", "--worker-urls", workers[0].url,
         workers[1].url, "--port", str(port), "--epp", "--epp-port", str(epp_port),
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        with grpc.insecure_channel(f"127.0.0.1:{epp_port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            wait_for(lambda: _check(channel, EXT_PROC_SERVICE)
                     == health_pb2.HealthCheckResponse.SERVING)
            picked = destination(_pick(channel), "request_body")
            assert sorted(picked) == sorted([workers[0].endpoint, workers[1].endpoint])
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, out  # a graceful exit, as without --epp
    assert f"endpoint picker (ext_proc gRPC) on 127.0.0.1:{epp_port}" in out


def test_epp_without_its_extra_is_one_line_error_before_waiting_on_workers(tmp_path: Any) -> None:
    (tmp_path / "grpc").mkdir()  # a grpcio that cannot be imported, as when the extra is missing
    (tmp_path / "grpc" / "__init__.py").write_text("raise ImportError('No module named grpc')\n")
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "prefixkv.cli", "route", "--worker-urls", "http://127.0.0.1:9",
         "--epp", "--startup-timeout", "60"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "prefixkv route: error: --epp needs the epp extra (pip install 'prefixkv[epp]'): "
        "No module named grpc"]
    assert time.monotonic() - t0 < 30  # it did not wait on the (unreachable) worker
