"""``prefixkv bench load`` against a real server: no failures, nothing leaked, cut streams counted."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_live import start_server

from prefixkv.bench.load import run_load
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
