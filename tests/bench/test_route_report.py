"""The router benchmark's pieces that need no workers: presets, meters, table and plot."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import pytest

from prefixkv.bench.route import report as bench_report
from prefixkv.bench.route.run import BENCH_POLICIES, build_parser
from prefixkv.bench.route.meters import CpuMeter, quantile, thread_cpu
from prefixkv.bench.route.workloads import WORKLOADS, resolve
from prefixkv.router.policies import POLICY_NAMES, Decision


def row(workload: str, policy: str, computed: int, imbalance: float) -> dict[str, object]:
    return {"workload": workload, "policy": policy, "requests": 4, "prompt_tokens": 1000,
            "cached_tokens": 1000 - computed, "computed_tokens": computed,
            "cached_share": 1 - computed / 1000, "seconds": 1.0, "requests_per_s": 4.0,
            "prompt_tokens_per_s": 1000.0, "per_worker": {"a": 3, "b": 1},
            "max_min_load": imbalance, "errors": 0, "reasons": {"hash": 4}, "p50_s": 0.1,
            "p99_s": 0.2, "policy_cpu_us": 30.0, "router_cpu_ms": None}


def test_presets_and_overrides() -> None:
    args = build_parser().parse_args(["--workloads", "eviction", "--users", "3"])
    spec = resolve("eviction", args)
    assert spec.users == 3 and spec.turns == WORKLOADS["eviction"].turns
    assert "--num-kv-blocks 64" in spec.worker_args
    assert resolve("chat", argparse.Namespace()).users == WORKLOADS["chat"].users
    with pytest.raises(ValueError, match="workload"):
        resolve("nope", args)
    assert set(POLICY_NAMES) < set(BENCH_POLICIES) and "cache_aware_sim" in BENCH_POLICIES
    defaults = build_parser().parse_args([])
    assert "cache_aware_sim_lru" not in defaults.policies  # on request only
    assert defaults.worker_eviction_policy is None


def test_meters() -> None:
    meter = CpuMeter(lambda urls, loads, key: Decision(urls[0], "x"))
    assert meter(["u"], {}, None).url == "u"
    assert meter.native_id == threading.get_native_id() and meter.seconds >= 0
    t = time.thread_time()
    while time.thread_time() - t < 0.05:
        pass
    cpu = thread_cpu(threading.get_native_id())
    assert cpu is None or cpu > 0
    assert thread_cpu(None) is None
    assert quantile([], 0.5) == 0.0
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile(list(range(100)), 0.99) == 99


def test_table_and_plot_from_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [row("chat", "cache_aware", 200, 1.0), row("chat", "consistent_hash", 300, 1.5),
            row("eviction", "round_robin", 900, float("inf"))]
    paths = []
    for i, part in enumerate((rows[:2], rows[2:])):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(part))
    png = tmp_path / "route.png"
    assert bench_report.main([*map(str, paths), "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and "1.50x" in out[2] and out[3].split()[4] == "900"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
