"""Owns: the body parts every dialect shares (lenient base, field types, a chat message).
Imports: pydantic and limits.py only; the cache admin bodies (strict: ours alone) live here too.

A dialect's request model subclasses :class:`_Body`: known fields are type- and range-checked,
unknown ones kept in ``model_extra`` for ``fields.py`` (one warning per name, or a 400 with
``--strict-fields``). The cache admin bodies forbid unknown fields: no other server has them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefixkv.server.limits import MAX_MESSAGES

MAX_LOGPROBS = 20
"""Most ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's
default ``max_logprobs``)."""

PositiveInt = Annotated[int, Field(strict=True, gt=0)]
TokenId = Annotated[int, Field(strict=True, ge=0)]
NumLogprobs = Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]


class _Body(BaseModel):
    """Base of request bodies: unknown fields are kept in ``model_extra`` (see ``fields.py``)."""

    model_config = ConfigDict(extra="allow")


class TextPart(_Body):
    """One ``{"type": "text", "text": ...}`` element of a message's content list."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """A chat message. Content is a string or a list of text parts (no images); assistant
    messages may carry ``tool_calls`` and ``tool`` messages a ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


# ---------------------------------------------------------------- cache admin


class _Strict(BaseModel):
    """Base of the cache admin bodies (ours alone, so an unknown field there is a 400)."""

    model_config = ConfigDict(extra="forbid")


class PrefixSpec(_Strict):
    """A prefix named by exactly one of ``token_ids``, ``text`` or ``messages``.

    ``text`` is tokenized as a completion prompt; ``messages`` are rendered with the chat
    template *without* the generation prompt (a system prompt pinned this way is the exact
    prefix of later chats). ``cache_salt`` selects the tenant namespace.
    """

    token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    text: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> PrefixSpec:
        given = [k for k in ("token_ids", "text", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of token_ids, text or messages")
        return self


class PinRequest(PrefixSpec):
    """``POST /v1/cache/pin``: compute the prefix if it is not cached, then pin it; with
    ``ttl_s`` or ``priority``, soft-retain it instead (docs/cache.md, "Retention": priority
    0-100, default 100; TTL in seconds renewed by every hit, default 300)."""

    description: str | None = None
    ttl_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    priority: Annotated[int, Field(strict=True, ge=0, le=100)] | None = None

    @property
    def soft(self) -> bool:
        """Whether this asks for a soft retention rather than a pin."""
        return self.ttl_s is not None or self.priority is not None


class LookupRequest(PrefixSpec):
    """``POST /v1/cache/lookup``: where a prefix is cached (any length)."""


class UnpinRequest(PrefixSpec):
    """``POST /v1/cache/unpin``."""
