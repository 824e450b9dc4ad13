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
    return LLM(demo_model, num_kv_blocks=128)


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
