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


# ---------------------------------------------------------------- bounds and the guarded compiler
def _ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _rule_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "x"\n'


def _nested_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("params", "message"), [
    (StructuredOutputsParams(json=_ref_chain(3000)), "3,001 \\$ref; at most 1,000"),  # was SIGSEGV
    (StructuredOutputsParams(grammar=_rule_chain(2800)), "2,802 rules; at most 1,000"),  # was SIGSEGV
    (StructuredOutputsParams(json="[" * 3000 + "]" * 3000), "nests deeper than 128"),  # RecursionError
    (StructuredOutputsParams(json={"default": _nested_list(200)}), "nests deeper than 128"),
    (StructuredOutputsParams(choice=[f"c{i}" for i in range(100_000)]), "100,000 choices; at most 4,096"),
    (StructuredOutputsParams(json={"anyOf": [{"const": i} for i in range(5000)]}), "5,000 anyOf"),
    (StructuredOutputsParams(json={"enum": list(range(5000))}), "5,000 enum/const values"),
    (StructuredOutputsParams(regex="a" * 70_000), "regex is 70,000 characters"),
    (StructuredOutputsParams(json={"description": "x" * 300_000}), "300,0.. characters"),
])
def test_constraints_over_the_bounds_are_value_errors_before_compiling(
        llm: LLM, params: StructuredOutputsParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params.to_grammar()
    with pytest.raises(ValueError, match=message):
        llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=params))
    assert not llm.engine.has_unfinished_requests()


def test_a_grammar_that_crashes_the_compiler_fails_alone(llm: LLM) -> None:
    # under every bound, yet deep enough to overflow the compiler on the guard child's stack:
    # that child dies (SIGSEGV), this request is a ValueError, and the next one is served
    for params in (StructuredOutputsParams(json=_ref_chain(900)), StructuredOutputsParams(grammar=_rule_chain(900))):
        with pytest.raises(ValueError, match="compiler crashed on it \\(SIGSEGV"):
            llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=params))
    ok = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate("?", ok)[0].outputs[0].text in {"yes", "no"}


def test_a_compile_over_the_budget_is_a_value_error_and_the_guard_recovers(demo_model: Any) -> None:
    from prefixkv.engine.grammar_guard import GrammarGuard

    tokenizer = (demo_model / "tokenizer.json").read_text()
    guard = GrammarGuard(tokenizer, 512, [0], workers=1, timeout_s=0.05)
    try:
        guard.check(StructuredOutputsParams(json_object=True).to_grammar())  # (starts the child)
        big = StructuredOutputsParams(json={"anyOf": [
            {"type": "object", "properties": {f"p{i}": {"type": "integer"}}, "required": [f"p{i}"]}
            for i in range(1000)]})
        with pytest.raises(ValueError, match="within 0.05 s"):
            guard.check(big.to_grammar())
        guard.timeout_s = 30
        guard.check(StructuredOutputsParams(choice=["a", "b"]).to_grammar())  # a fresh child
        with pytest.raises(ValueError, match="^invalid grammar: .*regex"):
            guard.check(StructuredOutputsParams(regex="(unclosed").to_grammar())
    finally:
        guard.close()


def test_a_panic_is_one_clean_line() -> None:
    from prefixkv.engine.grammar_guard import clean_error

    panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX\n<backtrace>\n   0: <unknown>\n"
    assert clean_error(panic) == "assertion failed: grammar.symbols.len() < u16::MAX"


def test_a_prepared_grammar_is_only_copied_on_the_engine_thread(demo_model: Any) -> None:
    # the server prepares off the engine thread; add_request's new_state must not compile again
    llm = LLM(demo_model, num_kv_blocks=64, constrained_json_disable_any_whitespace=True)
    compiler = llm.engine.grammar_compiler()
    checks: list[str] = []
    check = compiler.guard.check
    compiler.guard.check = lambda grammar: (checks.append(grammar), check(grammar))[1]  # type: ignore[method-assign]
    params = StructuredOutputsParams(json=SCHEMA)
    compiler.prepare(params)
    assert len(checks) == 1
    out = llm.generate("x", SamplingParams(n=2, max_tokens=64, temperature=1.0, seed=3, structured_outputs=params))
    assert len(checks) == 1  # copies of the prepared matcher
    assert all(json.loads(c.text)["colour"] in {"red", "green", "blue"} for c in out[0].outputs)
    llm.close()
