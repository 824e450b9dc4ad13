"""``prefixkv bench stall``: the decode stall a long prefill causes, per step budget."""

from __future__ import annotations

import pytest

from prefixkv.bench.stall import longest_gap, main


def test_the_decoding_request_keeps_producing_while_a_long_prompt_prefills() -> None:
    # 1,024 prompt tokens in 128-token chunks: the decode gets an output between chunks
    r = longest_gap(128, prompt_tokens=1024, repeats=1)
    assert (r.budget, r.repeats) == (128, 1) and r.longest_gap_ms > 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        longest_gap(0)


def test_cli_prints_a_line_per_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--budgets", "256", "--prompt-tokens", "64", "--repeats", "1"]) == 0
    assert capsys.readouterr().out.startswith("budget 256: longest gap")
