"""Structured outputs (llguidance) through ``LLM``: a random model still emits valid JSON,
choices and regex matches; bad grammars are a ValueError at submission."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from prefixkv.engine import LLM, SamplingParams
from prefixkv.engine.structured_output import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(demo_model: Any) -> LLM:
    # compact JSON: a random model pads JSON with whitespace (whitespace is allowed by default)
    return LLM(demo_model, num_kv_blocks=128, constrained_json_disable_any_whitespace=True)


def test_json_may_hold_whitespace_unless_disabled(demo_model: Any, llm: LLM) -> None:
    # vLLM's and SGLang's default: whitespace between JSON tokens is allowed, so a model trained
    # on pretty-printed JSON can write it (held to compact JSON, SmolLM2 answered "{}");
    # disable_any_whitespace per request, or the engine flag, keeps it compact
    space = {ord(c): 100.0 for c in " \n"}  # the demo's byte tokens; whitespace wherever allowed
    free = LLM(demo_model, num_kv_blocks=64)
    params = {"temperature": 0, "max_tokens": 6, "logit_bias": space}
    obj = StructuredOutputsParams(json_object=True)
    assert free.generate("x", SamplingParams(**params, structured_outputs=obj))[0].outputs[0].text[1:].strip() == ""
    compact = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    for engine, so in ((free, compact), (llm, obj)):
        text = engine.generate("x", SamplingParams(**params, structured_outputs=so))[0].outputs[0].text
        assert text.startswith("{") and not any(c in " \n" for c in text[:2])
    with pytest.raises(ValueError, match="disable_any_whitespace"):
        StructuredOutputsParams(json_object=True, disable_any_whitespace=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_is_valid(llm: LLM, seed: int) -> None:
    sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    c = llm.generate("Answer in JSON:", sp)[0].outputs[0]
    value = json.loads(c.text)
    assert set(value) == {"ok", "colour"} and isinstance(value["ok"], bool)
    assert value["colour"] in {"red", "green", "blue"}
    assert c.finish_reason == "stop"


def test_json_object_choice_and_regex(llm: LLM) -> None:
    obj = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json_object=True))
    text = llm.generate("{", obj)[0].outputs[0].text
    assert text.startswith("{")  # a random model may run out of tokens inside a string
    choice = SamplingParams(temperature=0.9, seed=4, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate("?", choice)[0].outputs[0].text in {"yes", "no"}
    rx = SamplingParams(temperature=0.9, seed=4, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]{2}"))
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", llm.generate("?", rx)[0].outputs[0].text)


def test_structured_output_with_n_and_logprobs(llm: LLM) -> None:
    sp = SamplingParams(
        n=2, temperature=1.0, seed=9, max_tokens=64, logprobs=1, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    out = llm.generate("JSON please", sp)[0]
    for c in out.outputs:
        assert json.loads(c.text)["colour"] in {"red", "green", "blue"}
        assert c.logprobs is not None and all(e[t].logprob > float("-inf") for t, e in zip(c.token_ids, c.logprobs))


def test_bad_structured_outputs_are_value_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice="ab")
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json="{not json")))
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    assert not llm.engine.has_unfinished_requests()
