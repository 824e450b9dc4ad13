"""vLLM's ``LLM()`` options: max_model_len, kv_cache_memory, dtype="auto", tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv.engine import LLM, SamplingParams
from prefixkv.engine.llm import parse_size


def test_max_model_len_shrinks_the_context(demo_model: Any) -> None:
    llm = LLM(demo_model, max_model_len=64, num_kv_blocks=32, dtype="auto", tokenizer=demo_model)
    assert llm.engine.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([1] * 60, SamplingParams(max_tokens=8))
    out = llm.generate([1] * 60, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(demo_model, max_model_len=10**6)


def test_kv_cache_memory_sizes_the_pool(demo_model: Any) -> None:
    small = LLM(demo_model, kv_cache_memory="4MiB")
    large = LLM(demo_model, kv_cache_memory=8 * 2**20)
    assert large.engine.kv.num_blocks == 2 * small.engine.kv.num_blocks
    with pytest.raises(ValueError, match="not both"):
        LLM(demo_model, kv_cache_memory="4MiB", kv_cache_memory_bytes=1 << 20)


@pytest.mark.parametrize("bad", ["lots", "-1G", 0, True, 1.5])
def test_parse_size_rejects_garbage(bad: Any) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_size(bad, "kv_cache_memory")
    assert parse_size("1.5 KiB", "x") == 1536



def test_detokenize_false_gives_ids_only(make_llm: Any) -> None:
    # vLLM's detokenize=False: the same tokens, no text, no decoded_token (a token-only
    # workload skips the detokenizer); stop strings need text, so they are refused
    llm = make_llm()
    base = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 1, "prompt_logprobs": 1}
    with_text = llm.generate("héllo world", SamplingParams(**base))[0]
    ids_only = llm.generate("héllo world", SamplingParams(**base, detokenize=False))[0]
    a, b = with_text.outputs[0], ids_only.outputs[0]
    assert b.token_ids == a.token_ids and a.text and b.text == ""
    assert b.logprobs is not None and a.logprobs is not None
    assert [e[t].logprob for e, t in zip(b.logprobs, b.token_ids)] == [e[t].logprob for e, t in zip(a.logprobs, a.token_ids)]
    assert all(lp.decoded_token is None for e in b.logprobs for lp in e.values())
    assert ids_only.prompt_logprobs is not None
    assert all(lp.decoded_token is None for e in ids_only.prompt_logprobs[1:] if e for lp in e.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize="no")  # type: ignore[arg-type]


def test_allowed_token_ids_limit_every_sampled_token(make_llm: Any) -> None:
    # vLLM's allowed_token_ids (a classifier's label set): greedy or sampled, nothing else comes
    llm = make_llm()
    allowed = [ord("y"), ord("n")]
    for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        out = llm.generate("Answer y or n:", SamplingParams(**params, max_tokens=8, ignore_eos=True,
                                                            allowed_token_ids=allowed))[0].outputs[0]
        assert len(out.token_ids) == 8 and set(out.token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids has token ids outside the vocabulary"):
        llm.generate("x", SamplingParams(allowed_token_ids=[10**6]))
