"""Sequence stop logic with the demo's byte-level tokenizer (no model needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixkv.engine.outputs import RequestMetrics
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.sequence import Request, Sequence
from prefixkv.models.tokenizer import IncrementalDetokenizer, Tokenizer

EOS = frozenset({256, 258})


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_model)


def make(tokenizer: Tokenizer, **params: object) -> Sequence:
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    req = Request("r", None, [65], sp, sp.max_tokens or 100, None, RequestMetrics(0.0))
    seq = Sequence(0, req, 0, sp, [65], 1, detokenizer=IncrementalDetokenizer(tokenizer))
    req.seqs.append(seq)
    return seq


def feed(seq: Sequence, text: str) -> None:
    for b in text.encode():
        seq.append_token(b, EOS, 1000)
        if seq.finish_reason:
            return


def test_eos_stops_unless_ignored(tokenizer: Tokenizer) -> None:
    seq = make(tokenizer, max_tokens=10)
    feed(seq, "hi")
    seq.append_token(258, EOS, 1000)
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", None, "hi")
    seq = make(tokenizer, max_tokens=10, ignore_eos=True)
    seq.append_token(258, EOS, 1000)
    assert seq.finish_reason is None


def test_stop_string_across_tokens_is_cut_and_held_back(tokenizer: Tokenizer) -> None:
    seq = make(tokenizer, max_tokens=50, stop=["END"])
    feed(seq, "abcEN")
    assert seq.finish_reason is None and seq.visible_text() == "abc"  # "EN" may start "END"
    feed(seq, "D more")
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", "END", "abc")


def test_multibyte_characters_and_length(tokenizer: Tokenizer) -> None:
    seq = make(tokenizer, max_tokens=4)
    feed(seq, "é€")  # 2 + 3 bytes: the 4th byte ends it mid-character
    assert seq.finish_reason == "length" and seq.num_output_tokens == 4
    assert seq.text == "é\ufffd"
