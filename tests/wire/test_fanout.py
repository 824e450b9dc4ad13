"""prefixkv.wire.fanout: a router's per-worker answer told from a server's own."""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv.wire.fanout import worker_row, worker_rows


def test_a_routers_answer_reads_as_its_rows() -> None:
    data = {"object": "list", "data": [worker_row("http://a", 200, {"num_free_blocks": 3}),
                                       worker_row("http://b", 502, "bad gateway")]}
    assert worker_rows(data) == [
        {"worker": "http://a", "status": 200, "body": {"num_free_blocks": 3}},
        {"worker": "http://b", "status": 502, "body": "bad gateway"}]


@pytest.mark.parametrize("data", [
    {"num_free_blocks": 3, "cache": None},  # a server's stats
    {"object": "list", "data": [{"token_ids": [1, 2], "blocks": 1}]},  # a server's pinned list
    {"object": "list", "data": []},  # nothing pinned
    {"error": {"message": "no", "type": "x"}},
    {"data": [{"worker": "http://a", "status": "200", "body": {}}]},  # not a status
    {"data": [{"worker": 1, "status": 200, "body": {}}]},
    {"data": [worker_row("http://a", 200, {}), "x"]},
    [worker_row("http://a", 200, {})],
    None, "text",
])
def test_anything_else_is_not_a_fan_out(data: Any) -> None:
    assert worker_rows(data) is None
