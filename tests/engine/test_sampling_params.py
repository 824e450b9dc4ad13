"""SamplingParams validation: ValueError naming the field."""

from __future__ import annotations

import pytest

from prefixkv.engine import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"n": 64, "seed": 2**64 - 2}, "seed"),  # issue 9: seed + i overflowed after queueing
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": 1.1}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias"),
        ({"logit_bias": {7: float("nan")}}, "logit_bias"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"skip_reading_prefix_cache": "yes"}, "skip_reading_prefix_cache"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"allowed_token_ids": "ab"}, "allowed_token_ids"),
        ({"structured_outputs": {"json": {}}}, "structured_outputs"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation() -> None:
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (1, 1.0, 1.0, -1, 16)
    assert not sp.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_ids == (3,)
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_samples_get_consecutive_seeds() -> None:
    sp = SamplingParams(n=3, seed=10)
    assert [sp.for_sample(i).seed for i in range(3)] == [10, 11, 12]
    assert SamplingParams(n=2).for_sample(1).seed is None


def test_logit_bias_is_clamped_to_openai_range() -> None:
    sp = SamplingParams(logit_bias={3: 500, 4: -1e9, 5: 0.5})
    assert sp.bias == ((3, 100.0), (4, -100.0), (5, 0.5))
    assert SamplingParams(presence_penalty=0.1).has_penalties and not SamplingParams().has_penalties
