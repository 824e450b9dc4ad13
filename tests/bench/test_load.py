"""``prefixkv bench load`` against a real server: no failures, nothing leaked, cut streams counted."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_live import start_server

from prefixkv.bench.load import engine_stats, run_from_args, run_load
from prefixkv.engine import AsyncEngine


def test_a_bounded_load_leaves_a_healthy_server_with_no_leaked_blocks() -> None:
    engine = AsyncEngine.from_args(None, block_size=16, num_kv_blocks=256)
    live = start_server(engine)
    try:
        report = asyncio.run(run_load(live.url, clients=16, requests=48, max_tokens=4,
                                      stream_share=0.5, cut_share=0.5, pid=os.getpid()))
    finally:
        live.stop()
        engine.shutdown()
    assert report.num_failures == 0, report.failures
    assert report.ok + report.cut_streams == 48 and report.cut_streams > 0
    assert report.leaked_blocks == 0 and report.locked_blocks == 0 and report.healthy_after
    assert report.rss_before_mb and report.rss_after_mb and 0 < report.p50_s <= report.p99_s


def test_stats_that_are_not_an_engines_check_nothing() -> None:
    """Only answers that carry an engine's block counts are summed; anything else (an error, a
    server that is not prefixkv, a worker that answered an error) leaves the check undone."""
    engine = {"num_running": 0, "num_waiting": 0, "num_kv_blocks": 8, "num_free_blocks": 7,
              "num_cached_blocks": 1}
    assert engine_stats(httpx.Response(200, json=engine)) == [engine]
    listed = {"object": "list", "data": [{"worker": "a", "status": 200, "body": engine}] * 2}
    assert engine_stats(httpx.Response(200, json=listed)) == [engine, engine]
    failed = {"data": [{"worker": "a", "status": 200, "body": engine},
                       {"worker": "b", "status": 503, "body": {"error": {"message": "down"}}}]}
    for resp in (httpx.Response(403, json=engine), httpx.Response(200, json={"ok": True}),
                 httpx.Response(200, json=failed), httpx.Response(200, text="not json"),
                 httpx.Response(200, json=[engine])):
        assert engine_stats(resp) == []


def test_a_server_that_is_not_there_is_a_report_not_a_traceback(capsys: Any) -> None:
    """Every request fails to connect and the checks after the load cannot run: the report
    says so and the exit status is 1 (it raised httpx.ConnectError after the load)."""
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = argparse.Namespace(url=f"http://127.0.0.1:{port}", clients=2, requests=4, max_tokens=2,
                              stream_share=0.5, cut_share=0.5, api_key=None, pid=None, json=False)
    assert run_from_args(args) == 1
    out = capsys.readouterr().out
    assert "4 failed {'ConnectError': 4}" in out
    assert "blocks not checked (the server did not answer: ConnectError" in out
