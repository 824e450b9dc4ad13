"""Which worker holds a stored Responses API answer: remembered from its header, bounded."""

from __future__ import annotations

import asyncio
import json

import httpx

from prefixkv.router.conversations import RESPONSE_ID_HEADER, StoredResponses


def test_a_stored_answer_is_remembered_and_the_oldest_forgotten_past_the_limit() -> None:
    stored = StoredResponses(limit=2)
    for i, url in enumerate(["http://a", "http://b", "http://c"]):
        stored.remember({RESPONSE_ID_HEADER: f"resp_{i}"}, 200, url)
    assert stored.holder("resp_0") is None  # forgotten: the oldest past the limit
    assert (stored.holder("resp_1"), stored.holder("resp_2")) == ("http://b", "http://c")
    assert stored.holder(None) is None


def test_failed_answers_and_answers_without_the_header_are_not_remembered() -> None:
    stored = StoredResponses()
    stored.remember({RESPONSE_ID_HEADER: "resp_x"}, 500, "http://a")
    stored.remember({}, 200, "http://a")
    assert stored.holder("resp_x") is None


def test_an_unknown_or_unhealthy_holder_is_a_404_naming_the_id() -> None:
    stored = StoredResponses()
    stored.remember({RESPONSE_ID_HEADER: "resp_1"}, 200, "http://down")

    async def ask(rid: str) -> tuple[int, dict[str, object]]:
        async with httpx.AsyncClient() as client:
            resp = await stored.forward(client, ["http://up"], "GET", rid, {})
        return resp.status_code, json.loads(bytes(resp.body))

    for rid in ("resp_1", "resp_unknown"):
        status, body = asyncio.run(ask(rid))
        assert status == 404 and rid in str(body)
