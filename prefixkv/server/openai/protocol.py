"""Owns: OpenAI's request bodies with vLLM's and SGLang's extension fields (completions, chat).
Imports: prefixkv.engine (limits, stop regex), prefixkv.wire (salt), the core's bodies, limits.

Request and response bodies of the HTTP API (OpenAI's shapes, vLLM's extensions).

Strict about values, tolerant about extensions: every known field is type- and
range-checked (a bad value is a 400 naming it), while an unknown field is kept aside in the
model's ``model_extra`` and ignored with one logged warning per name (see ``fields.py``;
``--strict-fields`` turns them into 400s). Fields we accept but cannot honour at every value
(``best_of`` above ``n``, ``suffix``) are 400s at those values, never silently dropped.

vLLM's extension fields: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``prompt_logprobs``, ``structured_outputs`` / ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, ``stream_options.continuous_usage_stats``,
``truncate_prompt_tokens`` / ``truncation_side``, ``return_tokens_as_token_ids``,
``logprob_token_ids`` and
``cache_salt`` (a tenant key: requests with different salts never share cached KV).
SGLang's: ``regex``, ``ebnf`` (a GBNF grammar), ``json_schema`` (completions), ``stop_regex``,
``no_stop_trim`` (its name for ``include_stop_str_in_output``) and ``extra_key`` (a cache
isolation key), so an SGLang client's request is honoured, not half-read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, field_validator, model_validator

from prefixkv.engine.sampling_params import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    check_logit_bias_size,
)
from prefixkv.engine.stop_regex import compile_stop_regex
from prefixkv.wire.kv_events import request_salt
from prefixkv.server.bodies import ChatMessage, NumLogprobs, PositiveInt, TokenId, _Body
from prefixkv.server.limits import MAX_MESSAGES

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage`` (no choices);
    ``continuous_usage_stats`` (vLLM) puts the running ``usage`` in every chunk."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: the schema the output must match."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is 'json_schema'")
        return self


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: StrictBool = False


class SamplingRequest(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: PositiveInt = 1
    best_of: PositiveInt | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(strict=True)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    min_tokens: Annotated[int, Field(strict=True, ge=0)] = 0
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    prompt_logprobs: NumLogprobs | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    no_stop_trim: StrictBool = False
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    extra_key: Annotated[str, Field(min_length=1)] | None = None
    """SGLang's cache-isolation key (:func:`~prefixkv.wire.kv_events.request_salt`)."""
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool | None = None
    logprob_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=128)] | None = None
    """vLLM's: the log-probabilities of these ids at each generated position, instead of the
    top ``logprobs`` (which must be set); every candidate is returned."""
    truncate_prompt_tokens: Annotated[int, Field(strict=True, ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")] | None = None
    user: str | None = None
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    """OpenAI's cache routing hint: this server caches every prefix anyway; ``prefixkv route``
    sends requests sharing a key to the same worker; hit rates are kept per key."""
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    """OpenAI's: ``"24h"`` retains the request's cached prefix a day (``server/retention.py``);
    ``"in_memory"`` leaves it to the eviction policy."""
    priority: Annotated[int, Field(strict=True)] | None = None
    """vLLM's / SGLang's: above 0, the retention priority of what the request caches (capped by
    ``--max-retention-priority``); this server does not schedule by it."""

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        if sum(map(len, stops)) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings hold at most {MAX_STOP_CHARS} characters together")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("stop_regex")
    @classmethod
    def _stop_regex_compiles(cls, value: str | list[str] | None) -> str | list[str] | None:
        compile_stop_regex(value)  # ValueError naming the pattern
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the context length) or >= 1")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_size_first(cls, value: Any) -> Any:
        """The size bound before pydantic checks each entry (100k entries: ~22 ms on the
        event loop, every other request waiting)."""
        if isinstance(value, dict):
            check_logit_bias_size(value)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids (as strings), got {key[:32]!r}")
        return value

    @model_validator(mode="after")
    def _checks(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def prompt_options(self, prompt: Any, max_model_len: int, add_special_tokens: bool = True) -> Any:
        """``prompt`` (text, ids, or a rendered chat dict) with vLLM's ``truncate_prompt_tokens``
        (keep the last k tokens, the first k with ``truncation_side`` ``"right"``; -1: the context
        length) and ``add_special_tokens`` attached."""
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        if keep is None and add_special_tokens:
            return prompt
        base = ({"prompt": prompt} if isinstance(prompt, str) else
                dict(prompt) if isinstance(prompt, dict) else {"prompt_token_ids": prompt})
        return {**base, "add_special_tokens": add_special_tokens, "truncate_prompt_tokens": keep,
                "truncation_side": self.truncation_side}

    def problems(self) -> list[tuple[str, str]]:
        """Cross-field errors as ``(param, message)`` (the server answers the first as a 400)."""
        out = []
        if self.best_of is not None and self.best_of != self.n:
            out.append(("best_of", f"best_of={self.best_of} is not supported: only best_of == n ({self.n})"))
        if isinstance(self, CompletionRequest) and self.max_tokens == 0 and not self.echo:
            out.append(("max_tokens", "max_tokens must be >= 1 (0 only with echo)"))
        wants = getattr(self, "logprobs", None)  # completions: an int (0 counts), chat: a bool
        if self.logprob_token_ids and (wants is None or wants is False):  # vLLM's rule
            out.append(("logprob_token_ids", "logprob_token_ids needs logprobs set"))
        if isinstance(self, ChatCompletionRequest):
            if self.top_logprobs and not self.logprobs:
                out.append(("top_logprobs", "top_logprobs needs logprobs=true"))
            choice = self.tool_choice
            names = [t.function.name for t in self.tools or []]
            if (isinstance(choice, NamedToolChoice) or choice == "required") and not names:
                out.append(("tool_choice", "tool_choice needs tools"))
            elif isinstance(choice, NamedToolChoice) and choice.function.name not in names:
                out.append(("tool_choice", f"tool_choice names {choice.function.name!r}, not one of the tools {names}"))
        return out

    @property
    def cache_namespace(self) -> str | None:
        """The engine's ``cache_salt`` for this request (``kv_events.request_salt``)."""
        return request_salt(self.cache_salt, self.extra_key)

    @property
    def stop_list(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def bias(self) -> dict[int, float] | None:
        """``logit_bias`` with int keys."""
        return None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, token ids, or a batch of either.

    ``echo`` puts the prompt before the completion (with ``logprobs``, the prompt tokens' too,
    the first one ``null``): what lm-eval's loglikelihood tasks read. ``max_tokens=0`` is
    allowed with ``echo`` (only the prompt's logprobs).
    """

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None
    echo: StrictBool = False
    logprobs: NumLogprobs | None = None
    suffix: str | None = None
    add_special_tokens: StrictBool = True
    json_schema: str | None = None
    """SGLang's: the completion is JSON matching this schema (a JSON string)."""

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported by this server")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or any(len(p) == 0 for p in value if isinstance(p, list | str))):
            raise ValueError("prompt must not be empty")
        if isinstance(value, str) and value == "":
            raise ValueError("prompt must not be empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class FunctionDef(_Body):
    """A tool's function: name, description, JSON-schema parameters."""

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    """``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Body):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this tool."""

    class _Name(_Body):
        name: str

    type: Literal["function"] = "function"
    function: _Name


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``.

    ``tools`` go to the chat template. ``tool_choice``: ``"none"`` / ``"auto"`` generate text
    (this server has no tool-call parser, so ``auto`` never returns ``tool_calls``);
    ``"required"`` or a named function constrain the output (structured outputs) to a call's
    arguments and return ``tool_calls``, as vLLM does.
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def plain_messages(self) -> list[dict[str, Any]]:
        """Messages as ``{"role", "content", ...}`` dicts for the chat template."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text()}
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            out.append(msg)
        return out

    @property
    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens
