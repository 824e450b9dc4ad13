"""Owns: structured-output constraints from request fields (compiled off the loop), tool calls back.
Imports: prefixkv.engine, errors.py, protocol.py.

From request fields to a structured-output constraint, and from its output to ``tool_calls``.

Sources, at most one per request (else a 400): ``response_format`` (``json_object`` /
``json_schema``), vLLM's ``structured_outputs`` and ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, SGLang's ``regex`` / ``ebnf`` / ``json_schema``, and a
chat ``tool_choice`` of ``"required"`` or a named function. As in vLLM, a named tool constrains the
output to that function's ``parameters`` schema, and ``"required"`` to a JSON array of
``{"name", "parameters"}`` calls; the text is then returned as ``tool_calls``. ``"auto"`` /
``"none"`` constrain nothing (the tools still reach the chat template).

:func:`output_constraint` also compiles the grammar before the request reaches the engine, on
a worker thread and first in a guarded child process (:mod:`prefixkv.engine.grammar_guard`):
a schema or grammar over the bounds of :mod:`prefixkv.engine.grammar_limits`, one that does not
compile, crashes the compiler or runs past its budget is a 400 naming the field, and neither the
event loop nor the engine thread waits on a compile.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from prefixkv.engine.async_engine import AsyncEngine
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.engine.structured_output import StructuredOutputsParams
from prefixkv.server.errors import APIError
from prefixkv.server.openai.protocol import ChatCompletionRequest, NamedToolChoice, SamplingRequest

_ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a chat output becomes tool calls: one named function, or a required array of calls."""

    name: str | None  # None: "required" (an array of {"name", "parameters"})


def structured_outputs(req: SamplingRequest) -> tuple[StructuredOutputsParams | None, ToolMode | None]:
    """The constraint a request asks for (``None`` if none) and, for forced tools, how to read it
    (nothing compiled: :func:`output_constraint` compiles it too)."""
    _, params, mode = _find(req)
    return params, mode


async def output_constraint(engine: AsyncEngine, req: SamplingRequest
                            ) -> tuple[StructuredOutputsParams | None, ToolMode | None]:
    """:func:`structured_outputs`, its grammar compiled (:func:`compile_constraint`)."""
    field, params, mode = _find(req)
    await compile_constraint(engine, params, "tools" if field == "tool_choice" else field)
    return params, mode


_COMPILER_LOCK = threading.Lock()  # one engine builds one compiler, however many ask at once


async def compile_constraint(engine: AsyncEngine, params: StructuredOutputsParams | None,
                             field: str) -> None:
    """Compile ``params``' grammar for ``engine`` now, off the event loop and the engine thread
    (guarded; kept, so the engine only copies it); a 400 naming ``field`` when it fails."""
    if params is None:
        return

    def prepare(llm: LLMEngine) -> None:
        with _COMPILER_LOCK:
            compiler = llm.grammar_compiler()
        compiler.prepare(params)

    try:
        await asyncio.to_thread(prepare, engine.engine)
    except ValueError as exc:
        raise APIError(f"{field}: {str(exc).removeprefix('structured_outputs: ')}", param=field,
                       code="invalid_structured_output") from exc


def _find(req: SamplingRequest) -> tuple[str, StructuredOutputsParams | None, ToolMode | None]:
    """The field that constrains the output, its constraint and tool mode (400 if several)."""
    found: list[tuple[str, StructuredOutputsParams, ToolMode | None]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredOutputsParams(json_object=True), None))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        schema = rf.json_schema.schema_
        so = StructuredOutputsParams(json=schema) if schema else StructuredOutputsParams(json_object=True)
        found.append(("response_format", so, None))
    so_req = req.structured_outputs
    if so_req is not None:
        found.append(("structured_outputs", _params(
            "structured_outputs", json=so_req.json_, json_object=so_req.json_object, regex=so_req.regex,
            choice=so_req.choice, grammar=so_req.grammar,
            disable_any_whitespace=so_req.disable_any_whitespace), None))
    for name, kw in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                     ("guided_grammar", "grammar"), ("regex", "regex"), ("ebnf", "grammar"),
                     ("json_schema", "json")):
        value = getattr(req, name, None)  # (json_schema: completions only)
        if value is not None:
            found.append((name, _params(name, **{kw: value}), None))
    if isinstance(req, ChatCompletionRequest):
        forced = _tool_constraint(req)
        if forced is not None:
            found.append(("tool_choice", *forced))
    if len(found) > 1:
        raise APIError(f"give at most one output constraint; got {[f[0] for f in found]}",
                       param=found[1][0])
    if not found:
        return "", None, None
    return found[0]


def _params(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise APIError(str(exc), param=field) from exc


def _tool_constraint(req: ChatCompletionRequest) -> tuple[StructuredOutputsParams, ToolMode] | None:
    tools = {t.function.name: t.function.parameters or _ANY_OBJECT for t in req.tools or []}
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        return StructuredOutputsParams(json=tools[name]), ToolMode(name)
    if choice != "required":
        return None
    calls = [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
         "required": ["name", "parameters"], "additionalProperties": False}
        for n, p in tools.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema), ToolMode(None)


def tool_calls(mode: ToolMode, text: str) -> list[dict[str, Any]] | None:
    """The ``tool_calls`` of a constrained output, or ``None`` if the text is not complete JSON
    (e.g. cut by ``max_tokens``): then it is returned as content."""
    if mode.name is not None:
        try:
            json.loads(text)
        except ValueError:
            return None
        return [_call(mode.name, text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list):
        return None
    return [_call(str(c.get("name")), json.dumps(c.get("parameters"))) for c in calls if isinstance(c, dict)]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
