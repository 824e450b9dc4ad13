"""``prefixkv benchmark --with-prefix-cache / --without-prefix-cache`` (seed 004)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixkv.cli import main


def test_both_ways_same_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b.json"
    assert main(["benchmark", "--requests", "3", "--prefix-len", "64", "--suffix-len", "8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["runs"]["without"]["prefill_tokens"] == 3 * 72
    # the cached engine prefills the prefix once (whole blocks of it), then only the rest
    assert res["runs"]["with"]["prefill_tokens"] == 72 + 2 * 8
    assert "TTFT without / with" in capsys.readouterr().out


def test_one_way_and_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["benchmark", "--with-prefix-cache", "--requests", "2", "--prefix-len", "32", "--suffix-len", "4"]) == 0
    text = capsys.readouterr().out
    assert "with" in text and "without" not in text
    assert main(["benchmark", "--requests", "0"]) == 1
