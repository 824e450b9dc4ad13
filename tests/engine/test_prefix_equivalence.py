"""Prefix caching never changes greedy outputs: both indexes, block sizes 1 / 16, a tiny pool
(eviction + preemption), chunked prefill, and many concurrent requests sharing a prefix.

The workload (12 prompts sharing a 40-token system prompt, one unrelated, one strict prefix of
the shared part) runs twice per config: cold, then against a warm cache.
"""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv.cache.policy_experts import ExpertsPolicy
from prefixkv.engine import LLM, SamplingParams
from prefixkv.runner import attention, cpu_attention

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def workload(helpers: Any) -> list[list[int]]:
    return helpers.shared_prefix_workload(12)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reference(demo_model: Any, helpers: Any) -> list[list[int]]:
    llm = LLM(demo_model, enable_prefix_caching=False, num_kv_blocks=256)
    return [o.outputs[0].token_ids for o in llm.generate(workload(helpers), GREEDY)]


CONFIGS = {
    "radix-bs16": dict(index="radix", block_size=16),
    "radix-bs1": dict(index="radix", block_size=1),
    "hash-bs16": dict(index="hash", block_size=16),
    "hash-bs1": dict(index="hash", block_size=1),
    "radix-bs4-chunked-few-seqs": dict(index="radix", block_size=4, max_num_batched_tokens=7, max_num_seqs=3),
    "hash-bs16-chunked": dict(index="hash", block_size=16, max_num_batched_tokens=20),
    "radix-tiny-pool": dict(index="radix", block_size=16, num_kv_blocks=10),
    "hash-tiny-pool": dict(index="hash", block_size=4, num_kv_blocks=40),
    "radix-bs1-tiny-pool": dict(index="radix", block_size=1, num_kv_blocks=150, max_num_batched_tokens=64),
    "radix-tiny-pool-ghost": dict(index="radix", block_size=16, num_kv_blocks=10, eviction_policy="ghost"),
    "hash-tiny-pool-lfu": dict(index="hash", block_size=4, num_kv_blocks=40, eviction_policy="lfu"),
    "radix-tiny-pool-fifo": dict(index="radix", block_size=4, num_kv_blocks=40, eviction_policy="fifo"),
    "radix-tiny-pool-experts": dict(index="radix", block_size=16, num_kv_blocks=10, eviction_policy="experts"),
    "hash-tiny-pool-experts": dict(index="hash", block_size=4, num_kv_blocks=40, eviction_policy="experts"),
    # the same policy forced onto its non-LRU experts first (the default starts on LRU)
    "radix-tiny-pool-experts-lru2": dict(index="radix", block_size=16, num_kv_blocks=10,
                                         eviction_policy=ExpertsPolicy(("lru2", "ghost", "s2"))),
    "hash-tiny-pool-experts-ghost": dict(index="hash", block_size=4, num_kv_blocks=40,
                                         eviction_policy=ExpertsPolicy(("ghost", "tail"))),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equal_with_and_without_cache(
    name: str, make_llm: Any, helpers: Any, reference: list[list[int]]
) -> None:
    llm = make_llm(**CONFIGS[name])
    prompts = workload(helpers)
    for _round in range(2):  # the second round runs against a warm cache
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        helpers.assert_no_leak(llm)
    stats = llm.get_stats()
    assert stats.num_cached_prompt_tokens > 0
    if "tiny-pool" in name:
        assert stats.num_preemptions > 0
        assert stats.cache is not None and stats.cache.evicted_blocks > 0


def test_no_cache_path_frees_everything(make_llm: Any, helpers: Any, reference: Any) -> None:
    llm = make_llm(enable_prefix_caching=False, block_size=4, num_kv_blocks=30)
    outs = llm.generate(workload(helpers), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert llm.engine.kv.pool.num_free == 30
    assert llm.get_stats().num_preemptions > 0
    assert llm.get_cache_stats() is None and llm.reset_prefix_cache() is False


@pytest.mark.parametrize("kernel_decodes", [True, False])
def test_decodes_on_a_long_shared_prefix_equal_the_uncached_ones(
    kernel_decodes: bool, make_llm: Any, helpers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight requests on a cached 400-token system prompt decode together; greedy tokens equal
    those of the same requests without a cache. Where the C kernel takes decodes it reads the
    shared blocks per sequence; on the torch path (no kernel, or kept off here) they are read
    once per step (the shared-prefix path: 7 x 400 copies saved, above its 2,400)."""
    monkeypatch.setattr(cpu_attention, "DECODES", kernel_decodes)
    system = helpers.tokens(3, 400)
    prompts = [system + helpers.tokens(200 + i, 2 + i) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = make_llm(enable_prefix_caching=False, num_kv_blocks=512)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    shared_steps: list[int] = []
    real = attention._decode_shared

    def counting(*args: Any) -> Any:
        shared_steps.append(1)
        return real(*args)

    monkeypatch.setattr(attention, "_decode_shared", counting)
    llm = make_llm(num_kv_blocks=512)
    llm.generate([system + [5]], params)  # the system prompt is cached before the batch
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    if kernel_decodes and cpu_attention.ENABLED:
        assert not shared_steps  # every decode in the kernel
    else:
        assert shared_steps  # the batch did take the shared-prefix path
    helpers.assert_no_leak(llm)



def test_a_large_vocabulary_model_packs_its_keys_and_decodes_the_same(
    demo_model: Any, tmp_path: Any, helpers: Any
) -> None:
    """A model whose vocabulary passes 65,536 ids (here 70,000: the demo model with a bigger
    tied embedding) puts its radix tree in 18-bit packed keys at block size 16 (with the C
    helper built); greedy tokens stay those of the same requests without a cache, with a pool
    small enough to evict, cold and warm, with partial-block rows reused."""
    import json
    import random
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from prefixkv.cache.radix_node import PACKED

    path = tmp_path / "bigvocab"
    shutil.copytree(demo_model, path)
    config = json.loads((path / "config.json").read_text())
    vocab = config["vocab_size"] = 70_000
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    weights["model.embed_tokens.weight"] = torch.randn(vocab, config["hidden_size"], generator=gen)
    weights.pop("lm_head.weight", None)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})

    rng = random.Random(0)
    system = [rng.randrange(65_536, vocab) for _ in range(100)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(vocab) for _ in range(1 + 3 * i)]}
               for i in range(10)]
    want = [o.outputs[0].token_ids
            for o in LLM(path, enable_prefix_caching=False, num_kv_blocks=256).generate(prompts, GREEDY)]
    llm = LLM(path, block_size=16, num_kv_blocks=24)
    for _round in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
        helpers.assert_no_leak(llm)
    cache = llm.engine.kv.cache
    assert cache is not None and cache._forest.key_typecode == ("P" if PACKED else "I")
    stats = llm.get_cache_stats()
    assert stats is not None and stats.matched_tokens > 0 and stats.partial_tokens > 0
    assert stats.evicted_blocks > 0
