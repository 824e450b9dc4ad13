"""A :class:`Tokenizer` rebuilt from a GGUF file's ``tokenizer.*`` metadata.

Byte-level BPE (``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen2/3, SmolLM, GPT-2) is
supported: vocabulary and merges from the file, the pre-tokenizer chosen by
``tokenizer.ggml.pre`` (each name maps to the split its Hugging Face ``tokenizer.json`` uses),
control and user-defined tokens as special tokens, BOS prepended when ``add_bos_token`` says so,
and the chat template from ``tokenizer.chat_template``. Other tokenizer models (SentencePiece
``llama``) and unknown pre-tokenizer names are rejected with ``ValueError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from prefixkv.models.gguf_file import GGUFFile
from prefixkv.models.tokenizer import Tokenizer

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for a ``tokenizer.ggml.pre`` name; ``ValueError`` for unknown names."""
    if name in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if name in ("llama-bpe", "llama3", "smaug-bpe"):
        return _split_then_bytes(_LLAMA3_SPLIT)
    if name in ("qwen2", "qwen35"):
        return _split_then_bytes(_QWEN2_SPLIT)
    raise ValueError(
        f"unsupported GGUF pre-tokenizer {name!r} (supported: gpt2, smollm, llama-bpe, qwen2)"
    )


def build_backend(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """The ``tokenizers`` object described by GGUF metadata ``meta``."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, i.e. BPE)")
    tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens") or []]
    if not tokens:
        raise ValueError("GGUF metadata lacks tokenizer.ggml.tokens")
    merges = [tuple(str(m).split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[(a, b) for a, b in merges],
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    backend.pre_tokenizer = pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    backend.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    special = [
        tokenizers.AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    backend.add_special_tokens(special)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[int(bos_id)]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    return backend


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The tokenizer and chat template stored in the GGUF file ``path``."""
    meta = GGUFFile(path).metadata
    backend = build_backend(meta)
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        tid = meta.get(key)
        return None if tid is None or not 0 <= int(tid) < len(tokens) else str(tokens[int(tid)])

    template = meta.get("tokenizer.chat_template")
    return Tokenizer(
        backend,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        chat_template=template if isinstance(template, str) else None,
    )
