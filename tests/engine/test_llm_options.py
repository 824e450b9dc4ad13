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

