"""``prefixkv bench hostile`` against a real server: each hostile case answered with its status,
the victim served beside it, the server healthy after (figures are reported, not asserted)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_live import LiveServer, start_server

from prefixkv.bench.hostile import (Case, Pinning, default_cases, loop_lag_buckets, main,
                                    run_hostile, worst_bucket)
from prefixkv.bench.hostile_victim import process_cpu_s
from prefixkv.engine import AsyncEngine


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    engine = AsyncEngine.from_args(None, block_size=16, num_kv_blocks=256)
    server = start_server(engine)
    yield server
    server.stop()
    engine.shutdown()


def test_each_case_is_refused_and_the_victim_is_served(live: LiveServer) -> None:
    big = "word " * 100_000  # 0.5 MB: past the demo model's 8,192-token context by characters
    cases = [
        Case.of("chat, big message", "/v1/chat/completions",
                {"messages": [{"role": "user", "content": big}]}),
        Case.of("1,000 stop strings", "/v1/completions",
                {"prompt": "hi", "max_tokens": 4, "stop": [f"s{i}" for i in range(1000)]}),
        Case("tokenize, lone surrogate", "/tokenize", b'{"prompt": "\\ud800x"}'),
    ]
    seen: list[str] = []
    report = run_hostile(live.url, cases, pid=os.getpid(), alone_requests=3, settle_s=0.1,
                         on_result=lambda rep, r: seen.append(r.label))
    assert seen == [c.label for c in cases]
    assert report.alone.n == 3 and report.alone.errors == 0 and report.alone.p50_s > 0
    assert [r.status for r in report.results] == [400, 400, 400]
    assert all(r.excerpt.startswith('{"error":') for r in report.results), report.results
    assert "prompt" in report.results[2].excerpt and "stop" in report.results[1].excerpt
    for r in report.results:
        assert r.victim.n >= 1 and r.victim.errors == 0, r
        assert r.rss_before_mb and r.rss_peak_mb and r.rss_peak_mb >= r.rss_before_mb
        assert set(report.targets(r)) == {"fast", "memory", "victim"}
    assert report.healthy_after


def test_the_command_runs_a_chosen_case_and_writes_json(
    live: LiveServer, tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "hostile.json"
    code = main(["--url", live.url, "--only", "lone surrogate", "--json", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert code == 0
    assert printed[0].startswith("victim alone: n=20 ")
    assert printed[1].startswith("tokenize, lone surrogate (0.0 MB, /tokenize): 400 in ")
    assert printed[-1] == "health after: True"
    data = json.loads(out.read_text())
    assert [r["status"] for r in data["results"]] == [400] and data["healthy_after"]
    assert data["results"][0]["rss_before_mb"] is None  # no --pid: memory not measured


def test_the_default_battery_covers_every_prompt_route() -> None:
    cases = default_cases(0.01)
    assert {c.path for c in cases} >= {
        "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
        "/v1/responses", "/tokenize", "/generate"}
    assert all(json.loads(c.body) is not None for c in cases)
    assert len(default_cases(10)[0].body) > 10_000_000


def test_it_is_a_prefixkv_bench_subcommand() -> None:
    from prefixkv.bench import hostile
    from prefixkv.cli import build_parser

    args = build_parser().parse_args(["bench", "hostile", "--url", "http://127.0.0.1:1",
                                      "--only", "tokenize", "--big-mb", "0.5"])
    assert args.func is hostile.run_from_args and args.only == ["tokenize"] and args.big_mb == 0.5


def test_the_worst_loop_stall_is_the_smallest_bucket_holding_every_new_lag(
    live: LiveServer
) -> None:
    buckets = loop_lag_buckets(live.url)  # the server's own series (zeros: no lifespan here)
    assert math.inf in buckets and 0.1 in buckets
    assert loop_lag_buckets("http://127.0.0.1:1") == {}
    before = {0.005: 10.0, 0.1: 12.0, math.inf: 12.0}
    assert worst_bucket(before, {0.005: 15.0, 0.1: 18.0, math.inf: 18.0}) == 0.1
    assert worst_bucket(before, {0.005: 15.0, 0.1: 17.0, math.inf: 18.0}) == math.inf
    assert worst_bucket(before, {0.005: 16.0, 0.1: 18.0, math.inf: 18.0}) == 0.005
    assert worst_bucket(before, before) is None and worst_bucket({}, before) is None


def _threads_cpus(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
def test_pinning_puts_every_thread_of_the_server_and_victim_apart_from_the_sender() -> None:
    busy = ("import threading, time\n"
            "for _ in range(2): threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "sum(range(3_000_000)); time.sleep(30)")
    procs = [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(2)]
    try:
        server, victim = (p.pid for p in procs)
        time.sleep(0.5)  # its threads started
        own, before = os.sched_getaffinity(0), _threads_cpus(server)
        cpu = process_cpu_s(server)
        assert cpu is not None and cpu > 0 and process_cpu_s(None) is None
        pinning = Pinning.split()
        assert pinning.sender.isdisjoint(pinning.server) and pinning.sender | pinning.server <= own
        with pinning.applied(server, victim):
            assert _threads_cpus(server) == _threads_cpus(victim) == {pinning.server}
            assert len(os.listdir(f"/proc/{server}/task")) == 3  # every thread, not the first
            assert _threads_cpus(os.getpid()) == {pinning.sender}
        assert _threads_cpus(server) == before and os.sched_getaffinity(0) == own
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_pin_with_a_url_needs_the_server_pid(live: LiveServer) -> None:
    with pytest.raises(SystemExit, match="--pid"):
        main(["--url", live.url, "--only", "lone surrogate", "--pin"])
    with pytest.raises(ValueError, match="pid"):
        run_hostile(live.url, [], pinning=Pinning(frozenset({0}), frozenset({0})))
