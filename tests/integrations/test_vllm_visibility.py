"""What the vLLM connector shows without vLLM (default suite): its Prometheus series fed by a real
worker's counters (prometheus_client on a registry of the test's own), and the Valkey tier's
KV-event facts over a real valkey-server: a write is announced once the server holds it, a key
the server deletes, expires or lacks at a load is announced removed."""

from __future__ import annotations

import functools
import logging
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry, Counter, Histogram
from test_vllm_logic import BS, GEOM, _kv, _output, _request

from prefixkv.integrations.vllm.config import ConnectorConfig
from prefixkv.integrations.vllm.events import REMOTE_MEDIUM, BlockFacts, TierEvents
from prefixkv.integrations.vllm.identity import make_keyer
from prefixkv.integrations.vllm.plan import DISK, GONE, HOST, REMOTE, LoadBlock, SaveBlock, StepPlan
from prefixkv.integrations.vllm.prom import TierMetrics
from prefixkv.integrations.vllm.remote_watch import RemoteWatch
from prefixkv.integrations.vllm.scheduler_side import SchedulerSide
from prefixkv.integrations.vllm.worker_side import WorkerSide
from prefixkv.tiers.remote import PREFIX, RemoteTier


def _metrics(registry: CollectorRegistry, tiers: tuple[str, ...] = ("host", "disk", "remote"),
             ) -> TierMetrics:
    return TierMetrics(functools.partial(Counter, registry=registry),
                       functools.partial(Histogram, registry=registry), ["model_name", "engine"],
                       {0: ["m", "0"]}, tiers)


def _value(registry: CollectorRegistry, name: str, tier: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "0", "tier": tier})


def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---------------------------------------------------------------------- Prometheus
def test_prometheus_series_count_a_workers_loads_failures_and_saves(tmp_path: Path) -> None:
    cfg = ConnectorConfig.from_extra({"kv_offload_size": "1MiB", "kv_disk_dir": str(tmp_path)})
    worker = WorkerSide(cfg, host_blocks=4)
    worker.register(_kv(), 6)
    worker.run_loads(StepPlan())
    worker.save([SaveBlock(0, b"a" * 32, slot=0), SaveBlock(1, b"b" * 32, slot=1)])
    assert worker.flush()
    worker.run_loads(StepPlan(loads=[LoadBlock(2, b"a" * 32, HOST, 0),
                                     LoadBlock(3, b"b" * 32, HOST, 1),
                                     LoadBlock(4, b"b" * 32, DISK),
                                     LoadBlock(5, b"x" * 32, GONE),   # left the host tier
                                     LoadBlock(1, b"y" * 32, DISK)]))  # never written
    registry = CollectorRegistry()
    metrics = _metrics(registry, ("host", "disk"))
    # every series shows from the start (a scrape before any load reads 0, not "absent")
    assert _value(registry, "vllm:prefixkv_loaded_blocks_total", "host") == 0
    assert _value(registry, "vllm:prefixkv_loaded_blocks_total", "remote") is None
    counts = worker.take_counts()
    metrics.observe(counts)
    nbytes = worker.block_nbytes
    want = {("vllm:prefixkv_loaded_blocks_total", "host"): 2,
            ("vllm:prefixkv_loaded_blocks_total", "disk"): 1,
            ("vllm:prefixkv_loaded_bytes_total", "host"): 2 * nbytes,
            ("vllm:prefixkv_loaded_bytes_total", "disk"): nbytes,
            ("vllm:prefixkv_load_failed_blocks_total", "host"): 1,
            ("vllm:prefixkv_load_failed_blocks_total", "disk"): 1,
            ("vllm:prefixkv_saved_blocks_total", "host"): 2,
            ("vllm:prefixkv_saved_blocks_total", "disk"): 2,
            ("vllm:prefixkv_load_seconds_count", "host"): 1,  # one step's load: one observation
            ("vllm:prefixkv_load_seconds_count", "disk"): 1}
    assert {k: _value(registry, *k) for k in want} == want
    host_s = _value(registry, "vllm:prefixkv_load_seconds_sum", "host")
    assert host_s == pytest.approx(counts["host_seconds"]) and host_s is not None and host_s > 0
    # the next step's stats add; a step without loads adds nothing
    worker.run_loads(StepPlan(loads=[LoadBlock(2, b"a" * 32, HOST, 0)]))
    metrics.observe(worker.take_counts())
    metrics.observe(worker.take_counts())
    assert _value(registry, "vllm:prefixkv_loaded_blocks_total", "host") == 3
    assert _value(registry, "vllm:prefixkv_load_seconds_count", "host") == 2
    assert _value(registry, "vllm:prefixkv_load_failed_blocks_total", "host") == 1
    with pytest.raises(ValueError, match="tiers"):
        _metrics(CollectorRegistry(), ("gpu",))
    worker.close()


# ---------------------------------------------------------------------- Valkey events
def _facts(req: Any, j: int) -> BlockFacts:
    return BlockFacts(block_hash=j, parent_hash=j - 1 if j else None,
                      token_ids=tuple(req.all_token_ids[j * BS:(j + 1) * BS]))


def test_remote_watch_announces_confirmed_writes_and_the_servers_drops(valkey_server: Any) -> None:
    remote = RemoteTier(valkey_server.url, "L", 8, timeout=5)
    watch = RemoteWatch(remote, valkey_server.url, timeout=5, interval=0.05)
    client = redis.Redis.from_url(valkey_server.url)
    try:
        def flags() -> str:
            return str(client.config_get("notify-keyspace-events")["notify-keyspace-events"])

        _until(lambda: "E" in flags())  # set by the watch's thread
        assert set("Exeg") <= set(flags())
        keys = [bytes([i]) * 32 for i in range(4)]
        for k in keys:
            remote.submit(k, b"p" * 8)
        watch.wrote(keys + [b"z" * 32])  # z never reaches the server: never announced
        stored: list[bytes] = []
        dropped: list[bytes] = []

        def collect() -> int:
            s, d = watch.take()
            stored.extend(s)
            dropped.extend(d)
            return len(stored) + len(dropped)

        _until(lambda: collect() == 4)
        assert sorted(stored) == sorted(keys)
        client.delete(PREFIX + keys[0])           # DEL: a reset, a quota trim
        client.pexpire(PREFIX + keys[1], 50)      # the server's expiry
        client.set(PREFIX + b"o" * 32, b"x")      # another instance's block: not ours
        client.delete(PREFIX + b"o" * 32)
        _until(lambda: collect() == 6)
        assert sorted(dropped) == sorted(keys[:2])
        watch.missing([keys[2], b"q" * 32])       # a load found it gone; q was never announced
        watch.missing([keys[2]])                  # reported once
        collect()
        assert dropped[2:] == [keys[2]]
        time.sleep(0.3)
        collect()
        assert len(stored) == 4 and len(dropped) == 3
    finally:
        watch.close()
        remote.close()


def test_remote_watch_rechecks_its_blocks_after_the_server_restarts(valkey_server: Any) -> None:
    remote = RemoteTier(valkey_server.url, "L", 8, timeout=5)
    watch = RemoteWatch(remote, valkey_server.url, timeout=0.5, interval=0.05)
    client = redis.Redis.from_url(valkey_server.url)
    try:
        remote.submit(b"k" * 32, b"p" * 8)
        watch.wrote([b"k" * 32])
        _until(lambda: watch.take()[0] == [b"k" * 32])
        # the server comes back empty, without telling: the lost subscription triggers a recheck
        client.shutdown(nosave=True)
        valkey_server.proc.wait()
        restarted = subprocess.Popen(
            [valkey_server.proc.args[0], "--port", str(valkey_server.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _until(lambda: _answers(valkey_server.port))
            _until(lambda: watch.take()[1] == [b"k" * 32], timeout=20)
        finally:
            restarted.kill()
            restarted.wait()
    finally:
        watch.close()
        remote.close()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def test_refused_config_is_said_once_and_load_misses_still_count(
        caplog: pytest.LogCaptureFixture, valkey_without_config: Any) -> None:
    server = valkey_without_config
    remote = RemoteTier(server.url, "L", 8, timeout=5)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.prefixkv"):
            watch = RemoteWatch(remote, server.url, timeout=5, interval=0.05)
            remote.submit(b"k" * 32, b"p" * 8)
            watch.wrote([b"k" * 32])
            _until(lambda: watch.take()[0] == [b"k" * 32])
        refused = [r for r in caplog.records if "refused CONFIG" in r.getMessage()]
        assert len(refused) == 1
        watch.missing([b"k" * 32])
        assert watch.take() == ([], [b"k" * 32])
        watch.close()
    finally:
        remote.close()


def test_worker_and_scheduler_announce_the_valkey_tier(valkey_server: Any) -> None:
    cfg = ConnectorConfig.from_extra({"kv_remote": valkey_server.url, "kv_remote_timeout": 5})
    worker = WorkerSide(cfg, host_blocks=0, kv_events=True)
    worker.register(_kv(), 6)
    assert worker.watch is not None
    worker.watch.interval = 0.05
    events = TierEvents(_facts)
    side = SchedulerSide(make_keyer("w", "m", GEOM, ""), 0, None, worker.remote.present
                         if worker.remote else None, events=events)
    tokens = list(range(9))
    side.track(_request("a", tokens))
    plan = side.build(_output(new=[SimpleNamespace(req_id="a", block_ids=([1, 2, 3],),
                                                   num_computed_tokens=0)], scheduled={"a": 9}))
    keys = [s.key for s in plan.saves]
    assert len(keys) == 2
    worker.run_loads(plan)
    worker.save(plan.saves)
    assert worker.flush()
    got: list[tuple[list[bytes], list[bytes]]] = []

    def changes() -> bool:
        got.append(worker.take_remote_changes())
        return sum(len(s) for s, _ in got) == 2

    _until(changes)
    for stored, dropped in got:
        side.tier_changed(REMOTE_MEDIUM, stored, dropped)
    announced = events.take()
    assert [(e.stored, e.medium) for e in announced] == [(True, REMOTE_MEDIUM)] * 2
    assert sorted(e.facts.token_ids for e in announced) == [tuple(tokens[:BS]),
                                                             tuple(tokens[BS:2 * BS])]
    # the server loses one (no notification reaches the worker: the subscription is cut first);
    # the next load finds it missing, fails that block (vLLM recomputes it) and announces it gone
    worker.watch.close()
    redis.Redis.from_url(valkey_server.url).delete(PREFIX + keys[1])
    worker.run_loads(StepPlan(loads=[LoadBlock(4, keys[0], REMOTE), LoadBlock(5, keys[1], REMOTE)]))
    worker.end_loads()  # the step's end (vLLM's wait_for_save): the streamed loads report then
    assert worker.take_failed() == {5}
    stored, dropped = worker.take_remote_changes()
    assert (stored, dropped) == ([], [keys[1]])
    side.tier_changed(REMOTE_MEDIUM, stored, dropped)
    assert [(e.stored, e.medium, e.key) for e in events.take()] == [(False, REMOTE_MEDIUM, keys[1])]
    counts = worker.take_counts()
    assert (counts["remote_blocks"], counts["remote_failed_blocks"]) == (1, 1)
    assert counts["saved_remote_blocks"] == 2 and len(counts["remote_load_times"]) == 1  # type: ignore[arg-type]
    worker.close()


def test_worker_watches_nothing_without_kv_events(valkey_server: Any) -> None:
    cfg = ConnectorConfig.from_extra({"kv_remote": valkey_server.url, "kv_remote_timeout": 5})
    worker = WorkerSide(cfg, host_blocks=0)
    worker.register(_kv(), 6)
    worker.save([SaveBlock(0, b"a" * 32)])
    assert worker.flush()
    assert worker.watch is None and worker.take_remote_changes() == ([], [])
    flags = redis.Redis.from_url(valkey_server.url).config_get("notify-keyspace-events")
    assert flags["notify-keyspace-events"] == ""  # the server's settings left alone
    worker.close()
