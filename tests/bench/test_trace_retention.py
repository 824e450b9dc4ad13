"""The trace simulator's retention replay: per-session TTLs against the policy alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixkv.bench import trace_retention
from prefixkv.bench.trace import TraceRequest, replay
from prefixkv.cache import Retention


def request(t_ms: float, ids: list[int]) -> TraceRequest:
    return TraceRequest(t_ms, len(ids) * 4, 1, tuple(ids))


def sessions() -> list[TraceRequest]:
    """Session A (3 blocks) comes back every 10 s; a one-off request (4 fresh blocks) arrives
    between its turns."""
    out = []
    for turn in range(6):
        out.append(request(turn * 10_000, [1, 2, 3]))
        out.append(request(turn * 10_000 + 1000, list(range(100 + 4 * turn, 104 + 4 * turn))))
    return out


def test_a_retained_session_keeps_its_context_under_fifo() -> None:
    """FIFO evicts by creation: session A's context (created first) goes although A came back
    after the one-off did; a retention renewed by A's hits keeps it, as long as it lasts."""
    reqs = [request(0, [1, 2, 3]), request(1000, [10, 11, 12, 13]), request(2000, [1, 2, 3]),
            request(3000, [20, 21, 22, 23]), request(4000, [1, 2, 3])]
    alone = replay(reqs, 8 * 4, "fifo", block_size=4, index="radix")
    kept = replay(reqs, 8 * 4, "fifo", block_size=4, index="radix",
                  retention=Retention(priority=50, ttl_s=100))
    assert kept.policy == "fifo+retain100s" and alone.policy == "fifo"
    assert (alone.hit_blocks, kept.hit_blocks) == (3, 6)


def test_uniform_retention_under_lru_is_lru() -> None:
    reqs = sessions()
    alone = replay(reqs, 8 * 4, "lru", block_size=4, index="hash")
    kept = replay(reqs, 8 * 4, "lru", block_size=4, index="hash",
                  retention=Retention(ttl_s=30))
    assert alone.hit_blocks > 0
    assert kept.hit_rate == alone.hit_rate  # expiry order = last use + TTL = LRU order


def test_session_gaps_and_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reqs = sessions()
    assert trace_retention.session_gaps(reqs)[:2] == [10.0, 10.0]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                          "output_length": 1, "hash_ids": list(r.hash_ids)})
                              for r in reqs))
    out = tmp_path / "rows.json"
    assert trace_retention.main([str(path), "--block-size", "4", "--capacity-tokens", "24",
                                 "--ttls", "15", "--policy", "fifo", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "p50 10.0 s" in text and "fifo+retain15s" in text
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["fifo", "fifo+retain15s"]
    with pytest.raises(ValueError, match="ttl_s"):
        trace_retention.main([str(path), "--block-size", "4", "--capacity-tokens", "24",
                              "--ttls", "0"])
