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


def test_a_ttl_that_fits_the_sessions_gap_keeps_its_context_under_fifo() -> None:
    """FIFO evicts by creation: session A's context (created first) goes although A came back
    after the one-off did. Every request retains: with a TTL shorter than the one-off's age
    but covering A's 2 s return, the one-off has decayed to the unretained when room is needed
    and goes first; with a long TTL both are retained and FIFO orders them as before."""
    reqs = [request(0, [1, 2, 3]), request(1000, [10, 11, 12, 13]), request(2000, [1, 2, 3]),
            request(3000, [20, 21, 22, 23]), request(4000, [1, 2, 3])]
    alone = replay(reqs, 8 * 4, "fifo", block_size=4, index="radix")
    fits = replay(reqs, 8 * 4, "fifo", block_size=4, index="radix",
                  retention=Retention(priority=50, ttl_s=1.5))
    long = replay(reqs, 8 * 4, "fifo", block_size=4, index="radix",
                  retention=Retention(priority=50, ttl_s=100))
    assert fits.policy == "fifo+retain1.5s" and alone.policy == "fifo"
    assert (alone.hit_blocks, fits.hit_blocks, long.hit_blocks) == (3, 6, 3)


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
    assert [r["row"]["policy"] for r in rows] == ["fifo", "fifo+retain15s"]
    assert rows[1]["retained_hit_rate"] == rows[1]["row"]["hit_rate"]  # --share 1: every one
    with pytest.raises(ValueError, match="ttl_s"):
        trace_retention.main([str(path), "--block-size", "4", "--capacity-tokens", "24",
                              "--ttls", "0"])


def test_a_share_of_sessions_retains() -> None:
    """Session A (first block 1) retains, the one-offs (20, 30) do not (``retains`` at share
    0.5: a fixed hash): under FIFO A keeps its context, the others' hit rate stays; the rows
    split the hit rates by the same sessions."""
    assert [trace_retention.retains(s, 0.5) for s in (1, 20, 30)] == [True, False, False]
    reqs = [request(0, [1, 2, 3]), request(1000, [20, 21, 22, 23]), request(2000, [1, 2, 3]),
            request(3000, [30, 31, 32, 33]), request(4000, [1, 2, 3])]
    alone, kept = trace_retention.run(reqs, [8 * 4], [100.0], policy="fifo", block_size=4,
                                      share=0.5)
    assert (alone.ttl_s, kept.ttl_s, kept.share) == (None, 100.0, 0.5)
    assert alone.retained_hit_rate == 12 / 36 and kept.retained_hit_rate == 24 / 36
    assert alone.others_hit_rate == kept.others_hit_rate == 0.0
    assert kept.row.hit_tokens == 24 and kept.row.policy == "fifo+retain100s"
    assert trace_retention.retains(7, 1.0)
