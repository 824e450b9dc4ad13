"""Request and response bodies of the HTTP API (OpenAI's shapes, vLLM's extensions).

Every request model forbids unknown fields, so a field we do not implement is a 400 that
names it instead of being silently ignored. A few OpenAI fields that clients commonly send
with their neutral value (``echo=false``, ``logprobs=null``, ``presence_penalty=0``, ...)
are accepted at that value only; any other value is a 400 saying it is not supported.

Extensions, as in vLLM: ``top_k``, ``stop_token_ids`` and ``cache_salt`` (a tenant key:
requests with different salts never share cached KV).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

# Fields accepted only at their neutral value: name -> allowed values.
_NEUTRAL_ONLY: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "parallel_tool_calls": (None, False, True),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}

PositiveInt = Annotated[int, Field(strict=True, gt=0)]
TokenId = Annotated[int, Field(strict=True, ge=0)]


class _Strict(BaseModel):
    """Base of request bodies: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage`` (no choices)."""

    include_usage: StrictBool = False


class SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: PositiveInt = 1
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None
    seed: Annotated[int, Field(strict=True)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    user: str | None = None
    # OpenAI fields accepted only at their neutral value (see _NEUTRAL_ONLY).
    echo: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    best_of: Any = None

    @field_validator(
        "echo", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
        "logit_bias", "best_of", check_fields=False,
    )
    @classmethod
    def _neutral_only(cls, value: Any, info: Any) -> Any:
        if value not in _NEUTRAL_ONLY[info.field_name]:
            raise ValueError(f"{info.field_name}={value!r} is not supported by this server")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, token ids, or a batch of either."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    suffix: Any = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Any) -> Any:
        if value not in _NEUTRAL_ONLY["suffix"]:
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


class TextPart(_Strict):
    """One ``{"type": "text", "text": ...}`` element of a message's content list."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """A chat message. Content is a string or a list of text parts (no images)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    parallel_tool_calls: Any = None
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None

    @field_validator("parallel_tool_calls", "tools", "tool_choice", "response_format")
    @classmethod
    def _chat_neutral_only(cls, value: Any, info: Any) -> Any:
        if value not in _NEUTRAL_ONLY[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    def plain_messages(self) -> list[dict[str, str]]:
        """Messages as ``{"role", "content"}`` dicts for the chat template."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    @property
    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens


# ---------------------------------------------------------------- cache admin


class PrefixSpec(_Strict):
    """A prefix named by exactly one of ``token_ids``, ``text`` or ``messages``.

    ``text`` is tokenized as a completion prompt; ``messages`` are rendered with the chat
    template *without* the generation prompt (a system prompt pinned this way is the exact
    prefix of later chats). ``cache_salt`` selects the tenant namespace.
    """

    token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    text: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> PrefixSpec:
        given = [k for k in ("token_ids", "text", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of token_ids, text or messages")
        return self


class PinRequest(PrefixSpec):
    """``POST /v1/cache/pin``: compute the prefix if it is not cached, then pin it."""

    description: str | None = None


class UnpinRequest(PrefixSpec):
    """``POST /v1/cache/unpin``."""
