"""A bounded API fuzz run (issue 9): schemathesis against the live server's ``/openapi.json``.

Every operation, checks ``not_a_server_error`` and response-schema conformance, a fixed seed
and a small example budget. Afterwards the server is healthy and no KV block leaked. The
engine behind it has a small pool and the server small caps on ``n`` and batch size, so no
generated request can run long.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_live import LiveServer, start_server, wait_idle

from prefixkv.engine import AsyncEngine
from prefixkv.server.limits import ServerLimits

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import (
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[LiveServer]:
    engine = AsyncEngine.from_args(None, block_size=16, num_kv_blocks=24)  # 384 tokens at most
    live = start_server(engine, limits=ServerLimits(max_n=2, max_prompts=4, default_chat_max_tokens=8))
    yield live
    live.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: LiveServer):  # type: ignore[no-untyped-def]
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=12, derandomize=True, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_no_server_errors_and_bodies_match_the_schema(case) -> None:  # type: ignore[no-untyped-def]
    response = case.call(timeout=60)
    case.validate_response(response, checks=[not_a_server_error, response_schema_conformance,
                                             status_code_conformance])


def test_after_fuzzing_the_server_is_healthy_and_nothing_leaked(fuzz_server: LiveServer) -> None:
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        stats = wait_idle(http, timeout=30)
        assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_kv_blocks"]
        r = http.post("/v1/completions", json={"prompt": "after the fuzz", "max_tokens": 2})
        assert r.status_code == 200, r.text
