"""The LoRA benchmark runs end to end on the demo model with tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixkv.bench import lora


@pytest.mark.parametrize("clock", [[], ["--cpu-time", "--threads", "1"]])
def test_lora_bench_rows_and_per_adapter_hits(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              clock: list[str]) -> None:
    out = tmp_path / "lora.json"
    assert lora.main(["--rank", "4", "--batch", "4", "--prompt-len", "48", "--decode-len", "4",
                      "--rounds", "1", "--json", str(out), *clock]) == 0
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"base", "1 adapter", "4 adapters"}
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in result["rows"].values())
    # every adapter computes the shared system prompt once, then reads it (its own blocks)
    assert {k: v[0] for k, v in result["hits"].items()} == dict.fromkeys(
        ("base", "a0", "a1", "a2", "a3"), 0)
    assert all(v[1] == 48 for v in result["hits"].values())
    assert "4 adapters" in capsys.readouterr().out


def test_a_row_counts_each_decode_token_once() -> None:
    import argparse
    import random

    from prefixkv.engine.llm import LLM

    args = argparse.Namespace(prompt_len=24, decode_len=5, cpu_time=True)
    with LLM(None, dtype="float32", num_kv_blocks=64) as llm:
        row = lora.run_row(llm, [None] * 3, args, random.Random(0))
    assert row["decode_tokens"] == 3 * (5 - 1)  # the first token of each is the prefill's
