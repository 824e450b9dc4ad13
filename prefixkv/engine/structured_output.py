"""Structured output: grammars that constrain sampling, compiled by llguidance.

    so = StructuredOutputsParams(json={"type": "object", "properties": {...}})
    SamplingParams(structured_outputs=so)         # vLLM's name and shape

The grammar work (JSON schema, regex, Lark, choice -> token masks) is done by `llguidance`
(guidance-ai's Rust library, also a vLLM and llama.cpp backend): one small wheel with no
dependencies that installs on CPU-only machines (xgrammar pulls triton; outlines-core would do
too but has no Lark grammars). This module owns only the mapping from request parameters to an
llguidance grammar and a per-sample :class:`GrammarState`; the runner turns a state into a
logits mask (:mod:`prefixkv.runner.logits_processors`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance

from prefixkv.engine import grammar_limits
from prefixkv.engine.grammar_guard import GrammarGuard


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint on the generated text (vLLM's ``StructuredOutputsParams``); set exactly one.

    Attributes:
        json: a JSON schema (a dict or its JSON text): the output is a JSON value matching it.
        json_object: ``True``: the output is some JSON object.
        regex: the output matches this regular expression (Rust ``regex`` syntax).
        choice: the output is exactly one of these strings.
        grammar: a Lark grammar (llguidance's dialect; GBNF is converted).
        disable_any_whitespace: JSON without free whitespace between its tokens (compact). By
            default, as in vLLM, the model may put whitespace there: models trained on
            pretty-printed JSON write it (held to compact JSON, SmolLM2 answered ``{}``).
    """

    json: str | Mapping[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    _text: dict[bool, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    """``to_grammar``'s answer per ``compact`` (the server and the engine both ask)."""

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "json_object", "regex", "choice", "grammar")
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, Mapping)):
            raise ValueError(f"structured_outputs.json must be a schema dict or str, got {self.json!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(  # noqa: TRY004
                f"structured_outputs.disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty str, got {v!r}")
        if self.choice is not None and (
            isinstance(self.choice, str)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"structured_outputs.choice must be a list of non-empty str, got {self.choice!r}")

    def to_grammar(self, *, compact: bool = False) -> str:
        """The llguidance grammar text of this constraint; ``ValueError`` if it is malformed or
        exceeds :mod:`~prefixkv.engine.grammar_limits` (nothing compiled yet);
        ``compact``: no free whitespace in JSON even if ``disable_any_whitespace`` is off."""
        compact = compact or self.disable_any_whitespace
        if compact not in self._text:
            try:
                self._text[compact] = self._grammar(compact)
            except (ValueError, TypeError, RecursionError) as exc:  # all the request's doing
                raise ValueError(f"structured_outputs: {exc}") from None
        return self._text[compact]

    def _grammar(self, compact: bool) -> str:
        options: dict[str, Any] = {"whitespace_flexible": not compact}
        if self.json is not None:
            schema = grammar_limits.parse_schema(self.json) if isinstance(self.json, str) else dict(self.json)
            grammar_limits.check_schema(schema)
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))  # type: ignore[arg-type]
        if self.json_object:
            return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options))  # type: ignore[arg-type]
        if self.regex is not None:
            grammar_limits.check_regex(self.regex)
            return str(llguidance.LLMatcher.grammar_from_regex(self.regex))
        if self.choice is not None:
            grammar_limits.check_choices(self.choice)
            return str(llguidance.grammar_from("choice", json.dumps(list(self.choice))))
        grammar_limits.check_grammar(self.grammar or "")
        return str(llguidance.grammar_from("grammar", self.grammar or ""))


class GrammarState:
    """The grammar state of one sample: which tokens may come next; advanced per token.

    ``matcher`` is the llguidance ``LLMatcher`` (the runner fills a token mask from it).
    """

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (one the mask allowed)."""
        self.matcher.consume_token(token_id)

    def is_done(self) -> bool:
        """Whether the grammar is complete (only a stop token could follow) or failed."""
        return bool(self.matcher.is_stopped() or self.matcher.is_error())


class GrammarCompiler:
    """Builds :class:`GrammarState` objects for one tokenizer (the llguidance vocabulary is built once).

    A grammar is compiled once, and only after a child process of :class:`GrammarGuard`
    compiled it on a smaller stack within the time budget (a grammar that would crash or hang
    the compiler is a ``ValueError`` for its request alone); each state is a copy of that
    matcher. :meth:`prepare` does this work, off the engine thread: the server calls it before
    it submits a request, so ``add_request`` only copies. Thread safe.

    Args:
        tokenizer_json: the Hugging Face ``tokenizers`` JSON of the model's tokenizer.
        vocab_size: the model's vocabulary (logits width), which may exceed the tokenizer's.
        eos_token_ids: the ids that end a sequence; a complete grammar allows only these.
        compact_json: JSON without free whitespace for every request (the engine's
            ``constrained_json_disable_any_whitespace``).
    """

    CACHED = 32
    """Compiled grammars kept (the most recently used) to copy states from."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int],
                 compact_json: bool = False) -> None:
        eos = sorted(set(eos_token_ids))
        self.vocab_size = vocab_size
        self.compact_json = compact_json
        self._tok = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos if eos else None
        )
        self.guard = GrammarGuard(tokenizer_json, vocab_size, eos)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def prepare(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """Check, guard-compile and keep ``params``' grammar (a no-op when it is kept);
        ``ValueError`` (``"structured_outputs: ..."``, one line) if it fails. Blocks for as long
        as the compile takes: call it off the engine thread."""
        grammar = params.to_grammar(compact=self.compact_json)
        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
                return matcher
        try:
            self.guard.check(grammar)
        except ValueError as exc:
            raise ValueError(f"structured_outputs: {exc}") from None
        matcher = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: invalid grammar: {matcher.get_error().splitlines()[0]}")
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > self.CACHED:
                self._compiled.popitem(last=False)
        return matcher

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh state at the start of the output (a copy of the prepared matcher; prepared
        now if it was not); ``ValueError`` if the grammar is invalid."""
        matcher = self.prepare(params)
        with self._lock:
            return GrammarState(matcher.deep_copy())
