"""Owns: the early cut of a body that holds one JSON string longer than any field could be.
Imports: limits.py (``PROMPT_CHARS_PER_TOKEN``) and Starlette's ``HTTPException`` only.

The batch routes (``/v1/completions``, its render, ``/generate``) cannot be given a total cap:
256 prompts, or 15 MB of token-id arrays, are valid bodies. But no valid body holds a *string*
longer than ``max(max_model_len * PROMPT_CHARS_PER_TOKEN, NON_PROMPT_STRING_CHARS)``
characters: a prompt over the first is refused by the length guard
(``limits.check_prompt_chars``) once parsed, and no other field takes anywhere near the second.
:class:`StringScan` follows the body chunk by chunk and says as soon as it provably holds such a
string, so the route answers 413 having read ~1 MiB of a 10 MB prompt, not all of it (reading,
joining and decoding the rest held the event loop and the other clients).

Why the proof holds. Take the *run* of bytes since the last ``"`` byte (across chunks). A run
without ``"`` lies entirely inside one string or entirely outside strings: entering or leaving a
string needs a ``"`` byte (an escaped ``\\"`` holds one too, and ends the run inside the string,
which only makes the run shorter than its string). Outside strings valid JSON holds only
structural bytes: ``0-9 , [ ] { } : . - + e E``, whitespace and the letters of ``true false
null``. So a run holding any other byte (a *texty* run) is inside one string, or the body is not
JSON (a 4xx either way). The run's characters are at least its bytes, less its UTF-8
continuation bytes (``0x80-0xBF``: a character of n bytes has n - 1), less 5 per backslash (an
escape is at most 6 bytes, ``\\uXXXX``, for one character, and holds a backslash): every
character adds at most 1 to that bound and a character cut at the run's end at most 1, so the
bound holds for every prefix of a run too. A token-id array is a run that is never texty and is
never cut, however long.

Every step is C-speed per chunk (``bytes.find`` / ``rfind`` / ``count`` / ``isascii`` /
``translate``; no Python loop over bytes or quotes). A texty byte is looked for with
``translate(None, STRUCTURAL)`` (empty: none), only while the run is not yet texty: measured
7x faster than a regex search over a 12 MB token-id batch (5 vs 38 ms), which is read whole.
The bound is checked where a run ends and at every :data:`CHECKPOINT_BYTES` of the body (fixed
offsets, not chunk ends), so the decision, and where it is made, depend on the body alone, not
on how it was split into chunks; a run lying between two quotes inside one checkpoint interval
is shorter than the interval, so under the limit, and needs no check.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException

from prefixkv.server.limits import PROMPT_CHARS_PER_TOKEN

__all__ = ["BATCH_ROUTES", "CHECKPOINT_BYTES", "NON_PROMPT_STRING_CHARS", "LongString",
           "LongStringTooLarge", "StringScan", "guarded_receive", "string_char_limit"]

BATCH_ROUTES = ("/v1/completions", "/v1/completions/render", "/generate")
"""The POST routes whose body may hold a batch of prompts (strings or token-id arrays)."""

NON_PROMPT_STRING_CHARS = 1 << 20
"""The longest string any other field may hold, generously: the largest non-prompt string is a
structured-output schema or grammar of 256 KiB compact (``engine/grammar_limits.py``), which
may come pretty-printed; a ``stop`` string is 4,096 characters at most."""

CHECKPOINT_BYTES = 256 << 10
"""Every this many bytes of the body the open run's bound is checked (never over the limit)."""

STRUCTURAL = b"0123456789,[]{}:.-+eE \t\n\rtruefalsn"
"""Every byte valid JSON may hold outside its strings."""

_CONTINUATION = bytes(range(0x80, 0xC0))


def string_char_limit(max_model_len: int) -> int:
    """The most characters a valid body's one string may hold at a ``max_model_len`` context."""
    return max(max_model_len * PROMPT_CHARS_PER_TOKEN, NON_PROMPT_STRING_CHARS)


@dataclass(frozen=True, slots=True)
class LongString:
    """A body holds a string of at least ``chars`` characters, seen by its byte ``at``."""

    chars: int
    at: int


class StringScan:
    """Follows one body's chunks (:meth:`feed`); says when it holds a string over ``limit``.

    The decision and the :class:`LongString` it gives are the same for every way the body is
    split into chunks (module docstring)."""

    __slots__ = ("limit", "checkpoint", "found", "_seen", "_bytes", "_cont", "_backslashes",
                 "_texty")

    def __init__(self, limit: int, checkpoint: int = CHECKPOINT_BYTES) -> None:
        if not 0 < checkpoint <= limit:
            raise ValueError(f"checkpoint must be in (0, limit={limit}], got {checkpoint}")
        self.limit = limit
        self.checkpoint = checkpoint
        self.found: LongString | None = None
        self._seen = 0  # body bytes fed
        self._bytes = self._cont = self._backslashes = 0  # the open run's
        self._texty = False

    def feed(self, chunk: bytes) -> LongString | None:
        """Take the body's next ``chunk``; the first :class:`LongString` found, so far."""
        pos = 0
        while pos < len(chunk) and self.found is None:
            room = self.checkpoint - self._seen % self.checkpoint
            piece = chunk if pos == 0 and room >= len(chunk) else chunk[pos:pos + room]
            self._piece(piece)
            pos += len(piece)
            if self._seen % self.checkpoint == 0:
                self._check()
        return self.found

    def _piece(self, piece: bytes) -> None:
        """One piece within a checkpoint interval: the run it ends is checked, the runs wholly
        inside it are shorter than the interval (never over), its tail opens the next run."""
        first = piece.find(b'"')
        if first < 0:
            self._extend(piece)
            self._seen += len(piece)
            return
        self._extend(piece[:first])
        self._seen += first
        self._check()
        last = piece.rfind(b'"')
        self._bytes = self._cont = self._backslashes = 0
        self._texty = False
        self._seen += last - first + 1
        self._extend(piece[last + 1:])
        self._seen += len(piece) - last - 1

    def _extend(self, part: bytes) -> None:
        """``part`` (no ``"`` in it) continues the open run."""
        self._bytes += len(part)
        if not self._texty:
            if not part.translate(None, STRUCTURAL):
                return  # no backslash nor byte >= 0x80 either: they are not structural
            self._texty = True
        if not part.isascii():
            self._cont += len(part) - len(part.translate(None, _CONTINUATION))
        self._backslashes += part.count(b"\\")

    def _check(self) -> None:
        if self._texty and self.found is None:
            chars = self._bytes - self._cont - 5 * self._backslashes
            if chars > self.limit:
                self.found = LongString(chars, self._seen)


class LongStringTooLarge(HTTPException):
    """Raised from ``receive`` when the body holds a string over the limit (answered 413)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


def guarded_receive(receive: Any, scan: StringScan,
                    too_large: Callable[[LongString], Exception]
                    ) -> Callable[[], Awaitable[dict[str, Any]]]:
    """``receive`` that feeds each body chunk to ``scan`` and raises ``too_large(found)`` as soon
    as it finds a string over its limit (the rest of the body is left unread)."""

    async def guarded() -> dict[str, Any]:
        message: dict[str, Any] = await receive()
        if message.get("type") == "http.request":
            found = scan.feed(message.get("body", b""))
            if found is not None:
                raise too_large(found)
        return message

    return guarded
