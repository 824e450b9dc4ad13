"""ModelConfig: both HF config layouts, per-architecture flags, clear rejections."""

from __future__ import annotations

import pytest

from prefixkv.models.config import ModelConfig

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def cfg(**over):
    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **BASE, **over})


def test_defaults_and_classic_layout():
    c = cfg(rope_theta=500000.0, eos_token_id=[1, 2], bos_token_id=0, torch_dtype="bfloat16")
    assert c.head_dim == 16 and c.num_key_value_heads == 4
    assert c.rope_theta == 500000.0 and c.rope_scaling is None
    assert c.eos_token_ids == (1, 2) and c.bos_token_id == 0
    assert c.torch_dtype == "bfloat16"
    assert not c.qkv_bias and not c.qk_norm and not c.tie_word_embeddings


def test_transformers_v5_layout_and_llama3_scaling():
    c = cfg(
        dtype="float32",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    assert c.rope_theta == 5e5 and c.rope_scaling is not None and c.rope_scaling.factor == 8.0
    assert c.torch_dtype == "float32"


def test_architecture_flags():
    q2 = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], **BASE})
    assert q2.qkv_bias and not q2.o_bias and not q2.qk_norm
    q3 = ModelConfig.from_dict({"model_type": "qwen3", **BASE, "head_dim": 32})
    assert q3.architecture == "Qwen3ForCausalLM" and q3.qk_norm and q3.head_dim == 32
    assert cfg(attention_bias=True).o_bias


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"architectures": ["MistralForCausalLM"]},
            "unsupported model architecture 'MistralForCausalLM'",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "unsupported rope scaling type 'yarn'",
        ),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_rejections_name_the_problem(over, message):
    with pytest.raises(ValueError, match=message):
        cfg(**over)
