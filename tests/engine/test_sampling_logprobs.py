"""Logprobs and prompt logprobs through ``LLM``: shapes, ranks, agreement between the decode
and prefill paths, and prompt logprobs that equal a cold run when the prompt is cached."""

from __future__ import annotations

import math
from typing import Any

import pytest

from prefixkv.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(demo_model: Any) -> LLM:
    return LLM(demo_model, num_kv_blocks=128)


def _vals(entries: list[Any]) -> list[Any]:
    return [None if e is None else {t: round(lp.logprob, 4) for t, lp in e.items()} for e in entries]


def test_logprobs_per_generated_token(llm: LLM) -> None:
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 6
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert next(iter(entry)) == tok  # the chosen id first
        assert entry[tok].rank == 1  # greedy picks the most likely token
        assert 3 <= len(entry) <= 4
        ranks = sorted(lp.rank for t, lp in entry.items() if t != tok or lp.rank == 1)
        assert ranks[:3] == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in entry.values())
        assert entry[tok].decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    none = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=2))[0].outputs[0]
    assert none.logprobs is None and none.cumulative_logprob is None


def test_sampled_token_outside_top_n_is_still_reported(llm: LLM) -> None:
    sp = SamplingParams(temperature=5.0, seed=3, max_tokens=12, logprobs=0, ignore_eos=True)
    c = llm.generate("abc", sp)[0].outputs[0]
    assert c.logprobs is not None
    assert all(list(e) == [t] for t, e in zip(c.token_ids, c.logprobs))  # logprobs=0: only the chosen
    assert any(e[t].rank > 1 for t, e in zip(c.token_ids, c.logprobs))  # hot sampling leaves rank 1


def test_decode_logprobs_equal_prompt_logprobs_of_the_same_text(llm: LLM) -> None:
    """The logprob of generated token i equals the prompt logprob of the same token when
    prompt + output is fed back as a prompt (decode path == prefill path)."""
    prompt = llm.tokenizer.encode("The quick brown fox")
    c = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True))[0].outputs[0]
    again = llm.generate(
        {"prompt_token_ids": prompt + c.token_ids}, SamplingParams(max_tokens=1, prompt_logprobs=2)
    )[0]
    assert again.prompt_logprobs is not None and again.prompt_logprobs[0] is None
    for i, tok in enumerate(c.token_ids):
        got = again.prompt_logprobs[len(prompt) + i]
        assert got is not None and c.logprobs is not None
        assert got[tok].logprob == pytest.approx(c.logprobs[i][tok].logprob, abs=1e-4)
        assert got[tok].rank == c.logprobs[i][tok].rank


def test_full_vocab_logprobs_are_a_distribution(llm: LLM) -> None:
    vocab = llm.engine.runner.config.vocab_size
    c = llm.generate("x", SamplingParams(temperature=0, max_tokens=1, logprobs=vocab))[0].outputs[0]
    assert c.logprobs is not None and len(c.logprobs[0]) == vocab
    assert sum(math.exp(lp.logprob) for lp in c.logprobs[0].values()) == pytest.approx(1.0, abs=1e-4)


def test_logprob_token_ids_add_those_ids_with_their_true_logprob_and_rank(llm: LLM) -> None:
    """vLLM's ``logprob_token_ids``: each generated (and prompt) position also reports these ids,
    with the values and ranks a full-vocabulary entry gives them."""
    vocab = llm.engine.runner.config.vocab_size
    labels = [ord("Y"), ord("N"), 250]
    full = llm.generate("Yes or no?", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=vocab,
                                                     prompt_logprobs=vocab))[0]
    some = llm.generate("Yes or no?", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                     logprob_token_ids=labels, prompt_logprobs=1))[0]
    c, f = some.outputs[0], full.outputs[0]
    assert c.token_ids == f.token_ids and c.logprobs is not None and f.logprobs is not None
    for entry, whole, tok in zip(c.logprobs, f.logprobs, c.token_ids):
        assert set(entry) == {tok, *labels}  # logprobs unset: 0 top ids, the chosen and the labels
        for t in labels:
            assert entry[t].logprob == pytest.approx(whole[t].logprob, abs=1e-5) and entry[t].rank == whole[t].rank
    assert some.prompt_logprobs is not None and full.prompt_logprobs is not None
    for entry, whole in zip(some.prompt_logprobs[1:], full.prompt_logprobs[1:]):
        assert entry is not None and whole is not None
        assert {t: round(entry[t].logprob, 4) for t in labels} == {t: round(whole[t].logprob, 4) for t in labels}
    for bad in ([], [-1], list(range(129)), "ab"):
        with pytest.raises(ValueError, match="logprob_token_ids"):
            SamplingParams(logprob_token_ids=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logprob_token_ids has token ids outside the vocabulary"):
        llm.generate("x", SamplingParams(logprob_token_ids=[vocab]))


def test_prompt_logprobs_on_a_cached_prompt_equal_a_cold_run(demo_model: Any, helpers: Any) -> None:
    prompt = helpers.tokens(7, 150)  # 9 full blocks + a partial one
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4, logprobs=2)
    cold = LLM(demo_model, num_kv_blocks=64, enable_prefix_caching=False)
    ref = cold.generate({"prompt_token_ids": prompt}, sp)[0]
    warm = LLM(demo_model, num_kv_blocks=64, max_num_batched_tokens=32)  # chunked prefill too
    warm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    assert warm.engine.is_prefix_cached(prompt)
    got = warm.generate({"prompt_token_ids": prompt}, sp)[0]
    assert got.num_cached_tokens == 0  # computed, not read from the cache
    assert ref.prompt_logprobs is not None and got.prompt_logprobs is not None
    assert len(got.prompt_logprobs) == len(prompt)
    assert _vals(got.prompt_logprobs) == _vals(ref.prompt_logprobs)
    assert [{t: lp.rank for t, lp in e.items()} for e in got.prompt_logprobs[1:] if e] == [
        {t: lp.rank for t, lp in e.items()} for e in ref.prompt_logprobs[1:] if e
    ]
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    # it still filled the cache: a plain request hits it
    hit = warm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))[0]
    assert hit.num_cached_tokens >= 144
    helpers.assert_no_leak(warm)


def test_prompt_logprobs_with_n_samples(llm: LLM) -> None:
    out = llm.generate("Shared prompt here", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3, prompt_logprobs=1))[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert all(e is not None for e in out.prompt_logprobs[1:])
    assert len(out.outputs) == 3


@pytest.mark.parametrize("index", ["radix", "hash"])
def test_prompt_logprobs_from_a_start_read_the_cache_up_to_it(demo_model: Any, helpers: Any, index: str) -> None:
    """SGLang's ``logprob_start_len``: the prompt is read from the cache up to the start and
    computed after it; the entries after the start equal a cold run's, those up to it are None
    whatever the cache held."""
    prompt = helpers.tokens(11, 150)
    start = 100
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, prompt_logprobs_start=start)
    cold = LLM(demo_model, num_kv_blocks=64, enable_prefix_caching=False)
    ref = cold.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))[0]
    warm = LLM(demo_model, num_kv_blocks=64, index=index, max_num_batched_tokens=32)
    warm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    got = warm.generate({"prompt_token_ids": prompt}, sp)[0]
    assert got.num_cached_tokens == start  # read up to it (the hashed index: 6 blocks + 4 rows)
    assert got.prompt_logprobs is not None and ref.prompt_logprobs is not None
    assert got.prompt_logprobs[: start + 1] == [None] * (start + 1)
    assert _vals(got.prompt_logprobs[start + 1 :]) == _vals(ref.prompt_logprobs[start + 1 :])
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    # cold, the same entries: the result does not depend on what was cached
    again = cold.generate({"prompt_token_ids": prompt}, sp)[0]
    assert again.prompt_logprobs is not None and again.prompt_logprobs[: start + 1] == [None] * (start + 1)
    assert _vals(again.prompt_logprobs) == _vals(got.prompt_logprobs)
    # a start past the prompt: every entry None, the whole prompt readable
    past = warm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=500))[0]
    assert past.prompt_logprobs == [None] * len(prompt) and past.num_cached_tokens >= 144
    helpers.assert_no_leak(warm)
    with pytest.raises(ValueError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs=1, prompt_logprobs_start=-1)
