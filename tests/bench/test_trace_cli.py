"""``prefixkv bench trace``: table, JSON rows, PNG plot, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixkv.bench.plots import plot_hit_rates
from prefixkv.bench.trace import load_trace, replay
from prefixkv.cli import build_parser, main

DATA = Path(__file__).parent / "data" / "mooncake_conversation_head400.jsonl"


def test_trace_command_writes_table_json_and_plot(tmp_path: Path, capsys) -> None:
    out_json, out_png = tmp_path / "rows.json", tmp_path / "sub" / "hit.png"
    rc = main(["bench", "trace", str(DATA), "--capacity-tokens", "300K", "1M",
               "--policies", "lru", "ghost", "belady", "--limit", "200",
               "--json", str(out_json), "--plot", str(out_png), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "200 requests" in text and "unbounded" in text and "belady" in text
    rows = json.loads(out_json.read_text())
    assert len(rows) == 3 * 2 + 1
    for row in rows:
        assert {"policy", "capacity_tokens", "hit_rate", "capacity_blocks", "hit_tokens",
                "input_tokens", "block_hit_rate", "hit_blocks", "requests", "evicted_blocks",
                "index", "block_size", "seconds"} <= set(row)
        assert 0.0 <= row["hit_rate"] <= 1.0 and row["requests"] == 200
    assert {(r["policy"], r["capacity_tokens"]) for r in rows} == {
        (p, c) for p in ("lru", "ghost", "belady") for c in (300_000, 1_000_000)
    } | {("unbounded", None)}
    unb = next(r for r in rows if r["capacity_tokens"] is None)
    assert all(r["hit_rate"] <= unb["hit_rate"] + 1e-12 for r in rows)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_hit_rates_writes_a_png(tmp_path: Path) -> None:
    t = load_trace(DATA)[:80]
    rows = [replay(t, c, "lru") for c in (50_000, 200_000)] + [replay(t, None)]
    path = plot_hit_rates(rows, tmp_path / "p.png", title="t")
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="finite"):
        plot_hit_rates(rows[-1:], tmp_path / "q.png")


@pytest.mark.parametrize(("argv", "message"), [
    (["--policies", "mru"], "--policies: unknown mru"),
    (["--capacity-tokens", "100"], "smaller than one block"),
    (["--capacity-tokens", "3X"], "capacity must be a token count"),
    (["--block-size", "0"], "--block-size"),
    (["--capacity-tokens", "unbounded", "--plot", "x.png"], "--plot needs"),
])
def test_bad_flags_exit_1_with_a_clear_message(argv: list[str], message: str, capsys) -> None:
    assert main(["bench", "trace", str(DATA), "--no-progress", *argv]) == 1
    assert message in capsys.readouterr().err


def test_bad_trace_file_exits_1_naming_the_line(tmp_path: Path, capsys) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(DATA.read_text().splitlines()[0] + "\n{not json}\n")
    assert main(["bench", "trace", str(p), "--no-progress"]) == 1
    assert "bad.jsonl line 2: invalid JSON" in capsys.readouterr().err


def test_bench_help_lists_trace(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "--help"])
    assert exc.value.code == 0
    assert "trace" in capsys.readouterr().out
