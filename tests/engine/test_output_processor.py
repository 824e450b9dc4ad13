"""Stop logic and reporting of the output processor with the demo's byte-level tokenizer (no
model needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixkv.engine.output_processor import OutputProcessor
from prefixkv.engine.outputs import Logprob, RequestMetrics
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.sequence import Request, Sequence
from prefixkv.models.tokenizer import IncrementalDetokenizer, Tokenizer

EOS = frozenset({256, 258})


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_model)


def make(tokenizer: Tokenizer, **params: object) -> tuple[OutputProcessor, Sequence]:
    proc = OutputProcessor(lambda sp: IncrementalDetokenizer(tokenizer), EOS, 1000)
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    req = Request("r", None, [65], sp, sp.max_tokens or 100, None, RequestMetrics(0.0))
    seq = Sequence(0, req, 0, sp, [65], 1)
    req.seqs.append(seq)
    proc.add(req)
    return proc, seq


def feed(proc: OutputProcessor, seq: Sequence, text: str) -> None:
    for b in text.encode():
        proc.process_token(seq, b)
        if seq.finish_reason:
            return


def test_eos_stops_unless_ignored(tokenizer: Tokenizer) -> None:
    proc, seq = make(tokenizer, max_tokens=10)
    feed(proc, seq, "hi")
    proc.process_token(seq, 258)
    out = proc.sample(seq)
    assert (seq.finish_reason, out.stop_reason, out.text) == ("stop", None, "hi")
    proc, seq = make(tokenizer, max_tokens=10, ignore_eos=True)
    proc.process_token(seq, 258)
    assert seq.finish_reason is None


def test_stop_string_across_tokens_is_cut_and_held_back(tokenizer: Tokenizer) -> None:
    proc, seq = make(tokenizer, max_tokens=50, stop=["END"])
    feed(proc, seq, "abcEN")
    assert seq.finish_reason is None and proc.visible_text(seq) == "abc"  # "EN" may start "END"
    feed(proc, seq, "D more")
    out = proc.sample(seq)
    assert (seq.finish_reason, out.stop_reason, out.text) == ("stop", "END", "abc")


def test_multibyte_characters_and_length(tokenizer: Tokenizer) -> None:
    proc, seq = make(tokenizer, max_tokens=4)
    feed(proc, seq, "é€")  # 2 + 3 bytes: the 4th byte ends it mid-character
    assert seq.finish_reason == "length" and seq.num_output_tokens == 4
    assert proc.sample(seq).text == "é"  # not "é\ufffd": the cut character is left out


def test_logprob_texts_are_the_text_each_token_adds(tokenizer: Tokenizer) -> None:
    # vLLM's decoded_token: a character split over byte tokens shows on the one completing it,
    # an alternative as what it would have added there; the chosen texts join up to the text
    proc, seq = make(tokenizer, max_tokens=10, logprobs=1)
    for b in "a€".encode():
        proc.process_token(seq, b, {b: Logprob(-0.1, 1, "own"), ord("z"): Logprob(-3.0, 2, "own")})
    out = proc.sample(seq)
    assert out.logprobs is not None and out.text == "a€"
    chosen = [e[t].decoded_token for e, t in zip(out.logprobs, seq.output_token_ids)]
    assert chosen == ["a", "", "", "€"] and "".join(chosen) == out.text
    assert [e[ord("z")].decoded_token for e in out.logprobs] == ["z", "z", "\ufffdz", "\ufffdz"]
    assert [e[ord("z")].logprob for e in out.logprobs] == [-3.0] * 4


def test_snapshot_changes_nothing_and_report_advances_the_deltas(tokenizer: Tokenizer) -> None:
    proc, seq = make(tokenizer, max_tokens=10, logprobs=0)
    proc.process_token(seq, ord("a"), {ord("a"): Logprob(-0.5)})
    first = proc.snapshot(seq.request)
    again = proc.snapshot(seq.request)
    assert first == again and first.outputs[0].delta_text == "a"
    assert proc.report(seq.request).outputs[0].delta_token_ids == [ord("a")]
    proc.process_token(seq, ord("b"), {ord("b"): Logprob(-0.25)})
    c = proc.report(seq.request).outputs[0]
    assert (c.text, c.delta_text, c.delta_token_ids, c.cumulative_logprob) == ("ab", "b", [ord("b")], -0.75)
    assert proc.snapshot(seq.request).outputs[0].delta_text == ""
    seq.finish_reason = "abort"
    assert proc.finish(seq.request).outputs[0].finish_reason == "abort"
    with pytest.raises(KeyError):
        proc.sample(seq)  # finished requests are forgotten
