"""Sampling through the engine: seeds, stop strings, stop regexes, stop token ids, max_tokens, n > 1."""

from __future__ import annotations

from typing import Any

import pytest
import regex

from prefixkv.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(demo_model: Any) -> LLM:
    return LLM(demo_model, num_kv_blocks=128)


PROMPT = "The quick brown fox"


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPT, sp)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    batched = llm.generate(["noise", PROMPT, "more noise"], [other, sp, other])[1]
    assert batched.outputs[0].token_ids == alone
    different = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=124, max_tokens=12, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone


def test_max_tokens_and_length(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 7 and c.finish_reason == "length" and c.stop_reason is None
    assert c.text == llm.tokenizer.decode(c.token_ids)


def test_stop_string_cuts_text(llm: LLM) -> None:
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = base.outputs[0].text
    stop = text[6:8]
    cut = text.index(stop)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop, "\x00"]))[0]
    c = out.outputs[0]
    assert c.text == text[:cut]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == base.outputs[0].token_ids[: len(c.token_ids)]


def test_stop_regex_keeps_the_text_up_to_the_token_that_completed_the_match(llm: LLM) -> None:
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    ids = base.outputs[0].token_ids
    text = base.outputs[0].text
    pattern = regex.escape(text[6]) + "." + regex.escape(text[8])  # spans several tokens
    # SGLang's rule: stop at the first token after which the output holds a match; keep it all
    k = next(k for k in range(1, len(ids) + 1) if regex.search(pattern, llm.tokenizer.decode(ids[:k])))
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop_regex=["\\x00{3}", pattern]))[0]
    c = out.outputs[0]
    assert c.token_ids == ids[:k] and c.text == llm.tokenizer.decode(ids[:k])
    assert c.finish_reason == "stop" and c.stop_reason == pattern
    # under min_tokens the text of the first tokens is not searched (vLLM's rule for stops)
    late = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_regex=pattern,
                                               min_tokens=k))[0].outputs[0]
    assert len(late.token_ids) > k and late.token_ids == ids[: len(late.token_ids)]


def test_stop_token_ids(llm: LLM) -> None:
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    ids = base.outputs[0].token_ids
    stop_id = ids[5]
    first = ids.index(stop_id)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))[0]
    c = out.outputs[0]
    assert c.token_ids == ids[: first + 1]  # the stop id is kept in token_ids
    assert c.finish_reason == "stop" and c.stop_reason == stop_id


def test_n_samples_share_the_prompt(llm: LLM, helpers: Any) -> None:
    llm.reset_prefix_cache()
    prompt = helpers.tokens(3, 70)
    before = llm.get_cache_stats()
    assert before is not None
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompt, sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(prompt, sp)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    after = llm.get_cache_stats()
    assert after is not None
    # the 3 later samples of the first request matched sample 0's prompt: 69 tokens each
    assert after.matched_tokens + after.partial_tokens - before.matched_tokens - before.partial_tokens >= 3 * 69
    greedy = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    helpers.assert_no_leak(llm)
