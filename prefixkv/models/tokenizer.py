"""Tokenizer of a local Hugging Face model directory, its chat template, streaming detokenizer.

Reads ``tokenizer.json`` (the ``tokenizers`` library does the work), ``tokenizer_config.json``
(``bos_token``, ``eos_token``, ``chat_template``) and, when present, ``chat_template.jinja``
(where transformers >= 5 stores the template). Chat templates are rendered with jinja2 in a
sandbox, with the globals HF templates expect (``raise_exception``, ``strftime_now``,
``tojson``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

_REPLACEMENT = "\ufffd"


def _token_text(value: Any) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (an AddedToken dump) -> ``"<s>"``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    ``eos_token_id`` / ``bos_token_id`` are ``None`` when the tokenizer config names no such
    token (or names one the vocabulary lacks).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.eos_token_id = None if eos_token is None else backend.token_to_id(eos_token)
        self._template = None if chat_template is None else _compile_template(chat_template)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from ``model_dir``; ``FileNotFoundError`` if ``tokenizer.json`` is missing."""
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer not found: {tok_file}")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            with cfg_file.open(encoding="utf-8") as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(
            backend,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            chat_template=template if isinstance(template, str) else None,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (added tokens included)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (e.g. BOS)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")  # noqa: TRY004
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 sequences come out as U+FFFD."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

        Extra keyword arguments are passed to the template (e.g. ``tools``; ``bos_token`` /
        ``eos_token`` override the tokenizer's). ``ValueError`` if the model has no template, a
        message is malformed, or the template raises anything (a ``TypeError`` from ``tools: 5``
        included: the template runs on the caller's values).
        """
        if self._template is None:
            raise ValueError("this model's tokenizer has no chat_template")
        if not isinstance(messages, Sequence) or isinstance(messages, str):
            raise ValueError("messages must be a list of {'role', 'content'} dicts")  # noqa: TRY004
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be a dict with a string 'role'")  # noqa: TRY004
        try:
            context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        except Exception as exc:  # the template is code run on the caller's values (tools: 5)
            raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never end in broken UTF-8.

    Text is held back while the newest tokens decode to an incomplete character (U+FFFD at the
    end); it is released once the character completes. Decoding uses a window of previous
    tokens so tokenizers that drop leading spaces on a lone token (SentencePiece) still join up.
    ``flush()`` releases whatever is held back at the end of the stream, less a character the
    stream ends in the middle of (as vLLM's detokenizer: a reply cut by ``max_tokens`` mid-way
    through a multi-byte character ends at the last whole one, not in U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens up to here have been emitted
        self.text = ""

    def push(self, token_ids: Iterable[int]) -> str:
        """Add ``token_ids``; return the newly complete text (possibly ``""``)."""
        self._ids.extend(token_ids)
        prefix_text = self._tok.decode(
            self._ids[self._prefix : self._read], skip_special_tokens=self._skip
        )
        full = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix_text):
            return ""
        delta = full[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def peek(self, token_ids: Sequence[int]) -> list[str]:
        """The text each of ``token_ids``, pushed next, would release now (``""`` while it leaves a
        character incomplete); changes nothing. vLLM's ``decoded_token`` of a logprob: the text a
        token adds in its context, so a character split over tokens shows on the one completing
        it (with what was held back) and a special token shows as itself."""
        window = self._ids[self._prefix :]
        prefix_len = len(self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip))
        out = []
        for t in token_ids:
            full = self._tok.decode([*window, t], skip_special_tokens=self._skip)
            text = "" if full.endswith(_REPLACEMENT) else full[prefix_len:]
            if not text and self._skip and not full.endswith(_REPLACEMENT):
                text = self._tok.decode([t], skip_special_tokens=False)  # a skipped special
            out.append(text)
        return out

    def flush(self) -> str:
        """Release held-back text, less the broken character at its end (the U+FFFD an incomplete
        UTF-8 sequence decodes to; one in the middle, followed by text, stays)."""
        prefix_text = self._tok.decode(
            self._ids[self._prefix : self._read], skip_special_tokens=self._skip
        )
        full = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        delta = full[len(prefix_text) :].rstrip(_REPLACEMENT)
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
