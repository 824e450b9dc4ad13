"""Benchmarking any router: router command lines, process meters, and the Rust routers side by
side on real prefixkv workers (slow; skipped unless scripts/install-router-peers.sh was run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixkv.bench.route import peers as bench_peers
from prefixkv.bench.route import run as bench
from prefixkv.bench.route.report import format_table

VENV = os.environ.get("ROUTER_PEERS_VENV", bench_peers.PEERS_VENV)


def args(*extra: str):
    return bench.build_parser().parse_args(["--cache-threshold", "0.4", *extra])


def test_router_commands_share_the_thresholds(tmp_path: Path) -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    ours = bench_peers.router_command("prefixkv", 9000, urls, args())
    assert ours[:4] == [sys.executable, "-m", "prefixkv.cli", "route"]
    assert ours[-3:] == ["--worker-urls", *urls]
    assert ours[ours.index("--cache-threshold") + 1] == "0.4"
    fake = tmp_path / "venv"
    (fake / "bin").mkdir(parents=True)
    for program in ("sglang-router", "vllm-router"):
        (fake / "bin" / program).touch()
    sg = bench_peers.router_command("sglang", 9001, urls, args(), str(fake))
    vl = bench_peers.router_command("vllm", 9002, urls, args(), str(fake))
    assert sg[:2] == [str(fake / "bin" / "sglang-router"), "launch"]
    assert vl[0] == str(fake / "bin" / "vllm-router") and vl[1] == "--host"
    for cmd in (sg, vl):
        assert cmd[cmd.index("--policy") + 1] == "cache_aware"
        assert cmd[cmd.index("--cache-threshold") + 1] == "0.4"
        assert cmd[cmd.index("--port") + 1] in ("9001", "9002")
        assert cmd[-3:] == ["--worker-urls", *urls]
    assert sg[sg.index("--prometheus-port") + 1] != vl[vl.index("--prometheus-port") + 1]


def test_router_command_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="install-router-peers.sh"):
        bench_peers.router_command("sglang", 9000, [], args(), str(tmp_path))
    with pytest.raises(ValueError, match="router must be one of"):
        bench_peers.router_command("nginx", 9000, [], args(), str(tmp_path))
    with pytest.raises(SystemExit):  # before any worker starts
        bench_peers.main(["--routers", "vllm", "--peers-venv", str(tmp_path)])


def test_process_meters_count_children() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    child = subprocess.Popen([sys.executable, "-c", burn + "time.sleep(30)"])
    try:
        shell = os.getpid()
        deadline = time.monotonic() + 20
        while (bench_peers.process_cpu(child.pid) or 0) < 0.25:
            assert time.monotonic() < deadline, "child never used its CPU"
            time.sleep(0.05)
        # this process's figure includes its child's
        assert (bench_peers.process_cpu(shell) or 0) >= (bench_peers.process_cpu(child.pid) or 0)
        own = bench_peers.process_rss_mb(child.pid, "VmRSS") or 0
        assert 1 < own <= (bench_peers.process_rss_mb(shell) or 0)
    finally:
        child.kill()
        child.wait()
    assert bench_peers.process_cpu(child.pid) is None
    assert bench_peers.process_rss_mb(child.pid) is None


def test_report_shows_rss_and_reads_older_json() -> None:
    row = {"workload": "chat", "policy": "sglang", "requests": 4, "prompt_tokens": 100,
           "cached_tokens": 40, "computed_tokens": 60, "cached_share": 0.4, "seconds": 1.0,
           "requests_per_s": 4.0, "prompt_tokens_per_s": 100.0, "per_worker": {"a": 2, "b": 2},
           "max_min_load": 1.0, "errors": 0, "reasons": {}, "p50_s": 0.1, "p99_s": 0.2,
           "policy_cpu_us": 0.0, "router_cpu_ms": 0.5}
    old = format_table([row]).splitlines()[1]  # no rss_mb: a JSON from before the column
    new = format_table([{**row, "rss_mb": 97.6}]).splitlines()[1]
    assert " - " in old.split("0.50", 1)[1][:9] and " 98 " in new


@pytest.mark.slow
@pytest.mark.skipif(not Path(VENV, "bin", "sglang-router").exists()
                    or not Path(VENV, "bin", "vllm-router").exists(),
                    reason="Rust routers not installed (scripts/install-router-peers.sh)")
def test_side_by_side_with_the_rust_routers(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    assert bench_peers.main(["--workers", "2", "--users", "4", "--turns", "2",
                             "--concurrency", "2", "--repeats", "1", "--peers-venv", VENV,
                             "--worker-args", "--block-size 16 --num-kv-blocks 128",
                             "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["prefixkv", "sglang", "vllm"]
    for r in rows:
        assert r["requests"] == 8 and r["errors"] == 0, r
        assert sum(r["per_worker"].values()) == 8  # counted at the workers for the Rust ones
        assert r["router_cpu_ms"] > 0 and r["rss_mb"] > 0
    assert len({r["prompt_tokens"] for r in rows}) == 1
