"""The endpoint picker's decision latency beside the HTTP proxy's added latency, same run.

Starts ``--workers`` instant stub workers (:mod:`prefixkv.bench.route.cost`'s) and one
``prefixkv route --epp`` over them (its own process: the HTTP router and the picker share its
policy), then, at concurrency 1 with unique ``--prompt-bytes`` prompts, in interleaved rounds:

* **EPP**: one ext_proc stream per request as Envoy drives it in full-duplex mode (request
  headers, the body in one message, then the response's end); the decision latency is from
  sending the body's last piece to the headers' answer carrying the pick, and ``echo`` until the
  whole body has come back (Envoy forwards only that);
* **HTTP**: the same prompts straight to a stub and through the router's HTTP port; the added
  latency is the router's median minus the direct median.

Also the router process's CPU per request for each path. Only same-run comparisons mean
anything::

    python -m prefixkv.bench.route.epp --prompt-bytes 16384 --rounds 5 --per-round 40
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixkv.bench.route.cost import _cpu_seconds, _post, _prompt
from prefixkv.router.local import free_port

_HEADERS = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
    base_pb2.HeaderValue(key=k, raw_value=v) for k, v in (
        (":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"application/json"))]))


def _epp_once(stub: pb_grpc.ExternalProcessorStub, body: bytes) -> tuple[float, float]:
    """One request's (decision, echo) seconds on a fresh stream."""
    out: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
    answers = stub.Process(iter(out.get, None))
    out.put(pb.ProcessingRequest(request_headers=_HEADERS))
    t0 = time.perf_counter()
    out.put(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    first = next(answers)
    decided = time.perf_counter() - t0
    if not first.HasField("request_headers"):
        raise RuntimeError(f"the picker did not pick: {first}")
    for answer in answers:
        if answer.request_body.response.body_mutation.streamed_response.end_of_stream:
            break
    echoed = time.perf_counter() - t0
    out.put(pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=True)))
    next(answers)
    out.put(None)
    return decided, echoed


def run(args: argparse.Namespace) -> dict[str, float]:
    """Start the stubs and the router, measure, stop them; the figures in ms."""
    ports = [free_port() for _ in range(args.workers)]
    stubs = [subprocess.Popen([sys.executable, "-m", "prefixkv.bench.route.cost", "--stub",
                               str(p)]) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    http_port, epp_port = free_port(), free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "prefixkv.cli", "route", "--worker-urls", *urls, "--port",
         str(http_port), "--epp", "--epp-port", str(epp_port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    router_url = f"http://127.0.0.1:{http_port}"
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{epp_port}")
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while True:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(
                    service="envoy.service.ext_proc.v3.ExternalProcessor"), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline or router.poll() is not None:
                raise RuntimeError("prefixkv route --epp did not become ready")
            time.sleep(0.2)
        stub = pb_grpc.ExternalProcessorStub(channel)
        n = 0

        def body() -> bytes:
            nonlocal n
            n += 1
            return json.dumps({"model": "stub", "prompt": _prompt(n, args.prompt_bytes),
                               "max_tokens": 1}).encode()

        decided, echoed, added, epp_cpu, http_cpu = [], [], [], 0.0, 0.0
        with httpx.Client(timeout=120) as client:
            for _ in range(5):  # warm up connections
                _epp_once(stub, body())
                _post(client, router_url, _prompt(0, args.prompt_bytes))
                _post(client, urls[0], _prompt(0, args.prompt_bytes))
            for _ in range(args.rounds):
                c0 = _cpu_seconds(router.pid)
                for _ in range(args.per_round):
                    d, e = _epp_once(stub, body())
                    decided.append(d)
                    echoed.append(e)
                c1 = _cpu_seconds(router.pid)
                through = [_post(client, router_url, _prompt(i, args.prompt_bytes))
                           for i in range(args.per_round)]
                c2 = _cpu_seconds(router.pid)
                direct = [_post(client, urls[0], _prompt(i, args.prompt_bytes))
                          for i in range(args.per_round)]
                added.append(statistics.median(through) - statistics.median(direct))
                epp_cpu += c1 - c0
                http_cpu += c2 - c1
        channel.close()
        total = args.rounds * args.per_round
        return {"epp_decision_ms_p50": 1e3 * statistics.median(decided),
                "epp_decision_ms_p90": 1e3 * statistics.quantiles(decided, n=10)[-1],
                "epp_with_echo_ms_p50": 1e3 * statistics.median(echoed),
                "http_added_ms_p50": 1e3 * statistics.median(added),
                "epp_router_cpu_ms_per_request": 1e3 * epp_cpu / total,
                "http_router_cpu_ms_per_request": 1e3 * http_cpu / total}
    finally:
        for proc in (router, *stubs):
            proc.terminate()
        for proc in (router, *stubs):
            proc.wait(timeout=30)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefixkv.bench.route.epp``: print the figures as JSON."""
    p = argparse.ArgumentParser(prog="python -m prefixkv.bench.route.epp",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prompt-bytes", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-round", type=int, default=40)
    args = p.parse_args(argv)
    print(json.dumps({k: round(v, 3) for k, v in run(args).items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
