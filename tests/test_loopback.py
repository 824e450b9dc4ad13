"""The admin rule's "local client": loopback peer and no proxy header (``prefixkv.loopback``),
as the server's and the router's admin routes apply it."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from prefixkv.loopback import is_local_client, proxy_header
from prefixkv.router.admin import refusal

PROXY = ["Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "x-forwarded-proto",
         "X-Original-Forwarded-For", "Via", "X-Real-IP", "X-Client-IP", "Client-IP",
         "CF-Connecting-IP", "True-Client-IP", "Fastly-Client-IP", "X-Cluster-Client-IP",
         "X-Envoy-External-Address"]


@pytest.mark.parametrize("name", PROXY)
def test_every_proxy_header_means_not_local(name: str) -> None:
    assert proxy_header(["accept", name]) == name
    assert not is_local_client("127.0.0.1", ["accept", name])


def test_a_direct_loopback_client_is_local() -> None:
    plain = ["host", "accept", "authorization", "content-type", "user-agent", "x-request-id"]
    assert proxy_header(plain) is None
    for host in ("127.0.0.1", "::1", "127.9.9.9", "localhost"):
        assert is_local_client(host, plain), host
    for host in ("10.0.0.2", "203.0.113.7", "", None, "testclient"):
        assert not is_local_client(host, plain), host


def _request(headers: dict[str, str], host: str = "127.0.0.1") -> Request:
    return Request({"type": "http", "method": "GET", "path": "/v1/cache/stats",
                    "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
                    "client": (host, 5555), "query_string": b""})


def test_the_router_refuses_a_same_host_proxys_clients() -> None:
    """(Was: the router, like the server, looked only at Forwarded / X-Forwarded-For.)"""
    assert refusal(_request({}), None) is None
    for name in ("X-Real-IP", "Via", "CF-Connecting-IP"):
        refused = refusal(_request({name: "203.0.113.7"}), None)
        assert refused is not None and refused.status_code == 403
    assert refusal(_request({"X-Real-IP": "203.0.113.7", "Authorization": "Bearer k"}), "k") is None
