"""Trace loading and replay through the cache core: hand-computed hit counts, validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixkv.bench.trace import (
    TraceRequest,
    TraceRow,
    format_ratios,
    format_table,
    format_tokens,
    load_trace,
    parse_tokens,
    parse_trace,
    replay,
)

DATA = Path(__file__).parent / "data" / "mooncake_conversation_head400.jsonl"
INDEXES = ("hash", "radix")


def _line(ts: float, n_in: int, ids: list[int], n_out: int = 1) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                       "hash_ids": ids})


def _trace(*reqs: tuple[float, int, list[int]], block_size: int) -> list[TraceRequest]:
    return parse_trace([_line(*r) for r in reqs], block_size=block_size)


# block size 2: r2's last block is partial, so its 2 matched blocks are worth 3 tokens
PARTIAL = ((0, 3, [1, 2]), (1000, 4, [1, 2]), (2000, 3, [1, 2]), (3000, 2, [5]),
           (4000, 6, [1, 6, 7]))


@pytest.mark.parametrize("index", INDEXES)
def test_hand_computed_hits_partial_blocks(index: str) -> None:
    t = _trace(*PARTIAL, block_size=2)
    unb = replay(t, None, block_size=2, index=index)
    assert (unb.hit_tokens, unb.input_tokens, unb.hit_blocks) == (9, 18, 5)  # 4 + 3 + 2 tokens
    assert unb.hit_rate == pytest.approx(0.5)
    assert unb.policy == "unbounded" and unb.capacity_tokens is None
    # 2 blocks: r3 evicts block 2, r4 evicts 5 (block 1 is locked by r4's match)
    two = replay(t, 4, "lru", block_size=2, index=index)
    assert (two.hit_tokens, two.evicted_blocks, two.capacity_blocks) == (9, 2, 2)
    # 1 block: r1, r2 hit block 1 (their tails do not fit), r3 evicts it, r4 misses
    one = replay(t, 2, "lru", block_size=2, index=index)
    assert (one.hit_tokens, one.hit_blocks) == (4, 2)


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize(("policy", "hits"), [("lru", 1), ("fifo", 1), ("lfu", 2),
                                               ("ghost", 2), ("belady", 2)])
def test_hand_computed_hits_per_policy(index: str, policy: str, hits: int) -> None:
    # capacity 2 blocks; at r3 LRU evicts block 1 (used at 1 s) rather than 2 (used at 1.5 s);
    # LFU, ghost (block 1 has 2 visits 1 s apart: a 1 s bonus) and Belady (block 2 is never
    # used again) keep it
    t = _trace((0, 1, [1]), (1000, 1, [1]), (1500, 1, [2]), (3000, 1, [3]), (4000, 1, [1]),
               block_size=1)
    row = replay(t, 2, policy, block_size=1, index=index)
    assert row.hit_tokens == hits
    assert row.policy == policy and row.requests == 5


def test_clock_index_gives_lru_the_same_result() -> None:
    t = load_trace(DATA)
    a = replay(t, 300_000, "lru", clock="timestamp")
    b = replay(t, 300_000, "lru", clock="index")
    assert a.hit_tokens == b.hit_tokens


def test_progress_counts_every_request() -> None:
    t = load_trace(DATA)
    seen: list[int] = []
    replay(t * 3, 200_000, "lru", progress=seen.append)  # 1,200 requests, reported by 500
    assert seen == [500, 500, 200]


def test_head_of_mooncake_trace_loads_and_replays() -> None:
    t = load_trace(DATA)
    assert len(t) == 400
    assert t[0].hash_ids[:3] == (0, 1, 2) and t[0].input_length == 6758
    unb = replay(t, None)
    lru = replay(t, 1_000_000, "lru")
    assert 0 < lru.hit_rate <= unb.hit_rate < 1
    assert unb.evicted_blocks == 0


@pytest.mark.parametrize(("text", "lineno", "message"), [
    ('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]', 2, "invalid JSON"),
    ('[1, 2]', 2, "expected a JSON object"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 1}', 2, "missing field(s) hash_ids"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1, 2]}', 2,
     "2 hash_ids for input_length 3"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', 2, "input_length"),
    ('{"timestamp": 0, "input_length": 3, "output_length": -1, "hash_ids": [1]}', 2,
     "output_length"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": ["a"]}', 2,
     "hash_ids must be a list of ints"),
    ('{"timestamp": -5, "input_length": 3, "output_length": 1, "hash_ids": [1]}', 2, "timestamp"),
])
def test_bad_lines_name_the_line(text: str, lineno: int, message: str) -> None:
    lines = [_line(0, 3, [9]), text]
    with pytest.raises(ValueError, match=rf"line {lineno}: .*{_re(message)}"):
        parse_trace(lines, block_size=4)


def test_timestamps_must_not_go_back(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join([_line(5, 4, [1]), "", _line(3, 4, [2])]) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl line 3: timestamp 3 is earlier"):
        load_trace(p, block_size=4)


def test_empty_trace_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="no requests"):
        parse_trace(["", "  "])
    with pytest.raises(ValueError, match="block_size"):
        parse_trace([_line(0, 1, [1])], block_size=0)
    t = _trace((0, 4, [1]), block_size=4)
    with pytest.raises(ValueError, match="capacity_tokens"):
        replay(t, 3, block_size=4)
    with pytest.raises(ValueError, match="index"):
        replay(t, 8, block_size=4, index="btree")
    with pytest.raises(ValueError, match="clock"):
        replay(t, 8, block_size=4, clock="wall")
    with pytest.raises(ValueError, match="eviction_policy"):
        replay(t, 8, "mru", block_size=4)


def test_token_counts_parse_and_format() -> None:
    assert parse_tokens("3M") == 3_000_000
    assert parse_tokens("2.5m") == 2_500_000
    assert parse_tokens("500K") == 500_000
    assert parse_tokens("65536") == 65536
    assert parse_tokens("unbounded") is None
    for bad in ("x", "-1M", "0", "1.5"):
        with pytest.raises(ValueError, match="capacity"):
            parse_tokens(bad)
    assert [format_tokens(n) for n in (3_000_000, 1_500_000, 500_000, 65536)] == [
        "3M", "1.5M", "500K", "65536"]


def test_format_table_has_every_policy_and_capacity() -> None:
    t = load_trace(DATA)[:100]
    rows = [replay(t, c, p) for p in ("lru", "belady") for c in (100_000, 1_000_000)]
    rows.append(replay(t, None))
    text = format_table(rows)
    assert text.splitlines()[0].split() == ["capacity", "(tokens)", "lru", "belady"]
    assert [line.split()[0] for line in text.splitlines()[2:]] == ["100K", "1M", "unbounded"]


def _re(s: str) -> str:
    import re

    return re.escape(s)


def test_gzipped_trace_loads_like_the_plain_one(tmp_path: Path) -> None:
    import gzip

    gz = tmp_path / "head.jsonl.gz"
    gz.write_bytes(gzip.compress(DATA.read_bytes()))
    assert load_trace(gz) == load_trace(DATA)
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="gzip"):
        load_trace(bad)
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.jsonl.gz")


def test_agentic_trace_in_the_repo_loads() -> None:
    path = Path(__file__).parents[2] / "data" / "weka_agentic" / "weka_agentic_a.jsonl.gz"
    reqs = load_trace(path)
    assert len(reqs) == 11_567
    assert sum(r.input_length for r in reqs) == 1_437_733_960


def test_rows_report_speed_memory_and_the_experts_chosen() -> None:
    reqs = load_trace(DATA)[:300]
    lru = replay(reqs, 300_000, "lru", index="radix")
    exp = replay(reqs, 300_000, "experts", index="radix")
    assert lru.policy_bytes == 0 and lru.expert_history is None and lru.expert_share is None
    assert lru.requests_per_s > 0 and exp.requests_per_s > 0
    assert exp.policy_bytes > 10_000          # a ghost table of a few thousand identities
    assert exp.expert_history and exp.expert_history[0][1] == "lru"
    assert exp.expert_share and sum(exp.expert_share.values()) == pytest.approx(1.0, abs=1e-3)
    text = format_ratios([lru, exp])
    assert "xlru @300K" in text and "experts" in text and "of requests" in text
    assert format_ratios([exp], baseline="nope") == ""


def test_experts_plot_from_the_command_line(tmp_path: Path, capsys) -> None:
    from prefixkv.cli import main

    png, js = tmp_path / "experts.png", tmp_path / "rows.json"
    rc = main(["bench", "trace", str(DATA), "--capacity-tokens", "300K", "1M", "--policies",
               "lru", "experts", "--limit", "200", "--index", "radix", "--no-unbounded",
               "--experts-plot", str(png), "--json", str(js), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "against lru in this run" in out and "experts @1M" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(js.read_text())
    assert {"requests_per_s", "policy_bytes", "expert_history", "expert_share"} <= set(rows[0])
    rc = main(["bench", "trace", str(DATA), "--policies", "lru", "--experts-plot",
               str(png), "--no-progress"])
    assert rc == 1 and "--experts-plot needs" in capsys.readouterr().err


def test_experts_plot_on_a_request_axis(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from prefixkv.bench.plots import plot_expert_history

    reqs = load_trace(DATA)[:200]
    row = replay(reqs, 300_000, "experts", index="radix")
    times = [r.timestamp / 1000 for r in reqs]
    late = TraceRow(**{**{f: getattr(row, f) for f in row.__slots__},  # a switch after the end
                       "expert_history": (*(row.expert_history or ()), (times[-1] + 5, "lru2"))})
    png = plot_expert_history([row, late], tmp_path / "e.png", end_time=times[-1],
                              request_times=times)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="expert_history"):
        plot_expert_history([replay(reqs, 300_000, "lru")], tmp_path / "x.png", end_time=1.0)


def test_experts_replays_the_same_in_every_process() -> None:
    """The hash index replays with block identities that do not depend on the process (no
    builtin ``hash``), so ``experts``, which samples blocks by identity, gives the same hit
    rate in two fresh interpreters with different hash seeds (radix was already stable)."""
    import subprocess
    import sys

    full = Path(__file__).parents[2] / "data" / "mooncake" / "mooncake_conversation_trace.jsonl"
    # 1,500 requests at 500K tokens: enough for experts to sample, switch and evict (the
    # 400-request head above replays identically whatever the identities)
    code = ("from prefixkv.bench.trace import load_trace, replay;"
            f"print(replay(load_trace({str(full)!r})[:1500], 500_000, 'experts',"
            " index='hash').hit_tokens)")
    out = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout
           for seed in ("1", "2")]
    assert out[0] == out[1] and int(out[0]) > 0
