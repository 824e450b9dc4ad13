"""The routing-cost benchmark end to end, tiny: stub workers, a router process, the figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from prefixkv.bench.route import cost as bench_cost


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_bench_cost_measures_the_router_against_direct_stubs(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    assert bench_cost.main(["--workers", "2", "--prompt-bytes", "2048", "--rounds", "2",
                            "--per-round", "3", "--throughput-requests", "16",
                            "--throughput-prompt-bytes", "4096", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures) == {"router", "direct"}
    router = figures["router"]
    assert router["req_per_s"] > 0 and figures["direct"]["req_per_s"] > 0
    assert router["cpu_ms_per_req"] > 0 and router["rss_start_mb"] > 10
    assert router["added_ms_c1"] > -50  # a median difference: noisy, but finite
