"""Live servers for the server tests: the demo model behind uvicorn on a loopback port.

One engine serves two apps for the whole session: ``server`` (open) and ``auth_server``
(``--api-key``). Both run in background threads on sockets bound to 127.0.0.1:0.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from server_live import API_KEY, BLOCK_SIZE, MODEL, NUM_KV_BLOCKS, LiveServer, start_server

from prefixkv.engine import AsyncEngine


@pytest.fixture(scope="session")
def engine() -> Iterator[AsyncEngine]:
    # compact JSON: the random demo model draws whitespace bytes as freely as any, so with the
    # default (whitespace allowed, as vLLM) its JSON rarely closes within a test's max_tokens
    eng = AsyncEngine.from_args(None, block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS,
                                constrained_json_disable_any_whitespace=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine: AsyncEngine) -> Iterator[LiveServer]:
    live = start_server(engine, model_name=MODEL)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def auth_server(engine: AsyncEngine) -> Iterator[LiveServer]:
    live = start_server(engine, model_name=MODEL, api_key=API_KEY)
    yield live
    live.stop()


@pytest.fixture()
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture()
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
