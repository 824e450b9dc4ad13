"""``HEAD /health`` and ``HEAD /metrics`` (uptime probes and load balancers ask HEAD): the GET's
status and headers, no body (issue 40 item 12: both were 405)."""

from __future__ import annotations

import httpx


def test_head_on_health_and_metrics_answers_200_without_a_body(http: httpx.Client) -> None:
    for path, kind in (("/health", "application/json"), ("/metrics", "text/plain")):
        got = http.get(path)
        head = http.head(path)
        assert head.status_code == got.status_code == 200, (path, head.status_code)
        assert head.content == b"" and head.headers["content-type"].startswith(kind)
    schema = http.get("/openapi.json").json()["paths"]
    assert "head" not in schema["/health"] and "head" not in schema["/metrics"]
