"""Penalties, logit_bias, min_p, min_tokens and stop-text handling through ``LLM``, checked
against the raw distribution the engine reports (full-vocabulary logprobs)."""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(demo_model: Any) -> LLM:
    return LLM(demo_model, num_kv_blocks=128)


PROMPT = "The quick brown fox"


def _greedy(llm: LLM, n: int = 12, **kw: Any) -> Any:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)
    return llm.generate(PROMPT, sp)[0].outputs[0]


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.7), (0.5, 1.0), (-2.0, 0.0)])
def test_presence_and_frequency_penalties_follow_vllm(llm: LLM, presence: float, frequency: float) -> None:
    vocab = llm.engine.runner.config.vocab_size
    c = _greedy(llm, presence_penalty=presence, frequency_penalty=frequency, logprobs=vocab)
    assert c.logprobs is not None
    for i, tok in enumerate(c.token_ids):
        # raw logprobs differ from the logits by a per-row constant, so the argmax agrees
        before = c.token_ids[:i]
        scores = {
            t: lp.logprob - frequency * before.count(t) - presence * (t in before)
            for t, lp in c.logprobs[i].items()
        }
        assert tok == max(scores, key=lambda t: (scores[t], -t))
    if presence > 0:
        assert c.token_ids != _greedy(llm).token_ids


def test_logit_bias_forces_and_forbids(llm: LLM) -> None:
    forced = _greedy(llm, n=5, logit_bias={ord("z"): 100})
    assert forced.token_ids == [ord("z")] * 5
    base = _greedy(llm, n=6).token_ids
    banned = _greedy(llm, n=6, logit_bias={base[0]: -100}).token_ids
    assert base[0] not in banned
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={10**6: 1.0}))


def test_repetition_penalty_changes_greedy_output(llm: LLM) -> None:
    base = _greedy(llm, n=16).token_ids
    penalised = _greedy(llm, n=16, repetition_penalty=3.0).token_ids
    assert penalised != base
    assert _greedy(llm, n=16, repetition_penalty=1.0).token_ids == base


def test_min_p_one_is_greedy_and_zero_changes_nothing(llm: LLM) -> None:
    greedy = _greedy(llm, n=10).token_ids
    sp = SamplingParams(temperature=1.0, seed=11, min_p=1.0, max_tokens=10, ignore_eos=True)
    assert llm.generate(PROMPT, sp)[0].outputs[0].token_ids == greedy
    plain = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    zero = SamplingParams(temperature=1.0, seed=11, min_p=0.0, max_tokens=10, ignore_eos=True)
    assert llm.generate(PROMPT, zero)[0].outputs[0].token_ids == llm.generate(PROMPT, plain)[0].outputs[0].token_ids


def test_min_tokens_masks_stop_ids_and_stop_strings(llm: LLM) -> None:
    base = _greedy(llm, n=16)
    first = base.token_ids[0]
    stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[first]))[0].outputs[0]
    assert stopped.token_ids == [first]
    held = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[first], min_tokens=4)
    )[0].outputs[0]
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]
    stop = base.text[0:2]
    early = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert early.text == ""
    late = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=16, stop=[stop], min_tokens=3, ignore_eos=True)
    )[0].outputs[0]
    assert len(late.token_ids) > 3 or late.finish_reason == "length"
    assert late.text.startswith(base.text[:3])


def test_include_stop_str_in_output(llm: LLM) -> None:
    text = _greedy(llm, n=24).text
    stop = text[6:8]
    cut = text.index(stop)
    kept = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)] and kept.stop_reason == stop


def test_stop_token_text_is_left_out_unless_asked(llm: LLM) -> None:
    base = _greedy(llm, n=16)
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))[0].outputs[0]
    assert plain.token_ids == base.token_ids[: first + 1]
    assert plain.text == llm.tokenizer.decode(base.token_ids[:first])
    kept = llm.generate(
        PROMPT,
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == llm.tokenizer.decode(base.token_ids[: first + 1])
