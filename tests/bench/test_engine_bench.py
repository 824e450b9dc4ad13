"""The engine benchmark script runs end to end (tiny sizes; figures are not checked here)."""

from __future__ import annotations

import json
from pathlib import Path

from prefixkv.bench.engine import main
from prefixkv.bench.seed_table import table_prompt


def test_bench_smoke(tmp_path: Path, capsys: object) -> None:
    out = tmp_path / "bench.json"
    args = ["--prefix-len", "64", "--suffix-len", "8", "--decode-tokens", "4", "--repeats", "1",
            "--table-rows", "2", "--table-max-tokens", "2", "--no-hf", "--json", str(out)]
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert res["ttft"]["cached_tokens_warm"] == 64
    assert res["ttft"]["ttft_warm_steady_s"] > 0 and res["ttft"]["speedup_steady"] > 0
    assert res["decode"]["ours_tok_s"] > 0
    runs = res["table_demo"]["runs"]
    assert runs[1]["cached_tokens"] > 0 and len(runs) == 2
    assert "John Doe" in table_prompt(1) and "Zack Blue" in table_prompt()
