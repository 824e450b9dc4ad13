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
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
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


# ------------------------------------------------ deep and long schemas and grammars (issue 40)

def _ref_chain(n: int) -> dict[str, object]:
    defs: dict[str, object] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _nested(n: int, wide: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for i in range(n):
        schema = {"type": "object", "properties": {f"p{j}": schema for j in range(wide)} if i < 3 else {"a": schema}}
    return schema


_SIZES = st.sampled_from([0, 1, 50, 600, 900, 999, 1000, 1001, 3000])
_CONSTRAINTS = st.one_of(
    _SIZES.map(lambda n: ("guided_json", _ref_chain(n))),
    st.tuples(st.sampled_from([1, 60, 127, 129, 400]), st.integers(1, 3)).map(
        lambda t: ("guided_json", _nested(*t))),
    _SIZES.map(lambda n: ("guided_json", {"anyOf": [{"const": i} for i in range(n)] or [{"type": "null"}]})),
    _SIZES.map(lambda n: ("guided_json", "[" * n + "]" * n or "{}")),
    _SIZES.map(lambda n: ("guided_grammar", "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n')),
    _SIZES.map(lambda n: ("guided_regex", "(" * n + "a" + ")" * n)),
    st.sampled_from([1, 4096, 4097, 20_000]).map(lambda n: ("guided_choice", [f"c{i}" for i in range(n)])),
)


@given(constraint=_CONSTRAINTS, chat=st.booleans())
@settings(max_examples=20, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_deep_and_long_constraints_are_answered_without_a_server_error(
        fuzz_server: LiveServer, constraint: tuple[str, object], chat: bool) -> None:
    field, value = constraint
    body: dict[str, object] = {"max_tokens": 2, field: value}
    if chat:
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "x"}]
    else:
        route, body["prompt"] = "/v1/completions", "x"
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as http:
        r = http.post(route, json=body)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            error = r.json()["error"]
            assert error["param"] == field and "\n" not in error["message"], error
        assert http.get("/health").status_code == 200
