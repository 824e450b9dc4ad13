"""A GGUF's tokenizer written out as a Hugging Face tokenizer directory.

Benchmark clients (guidellm, aiperf, vLLM's ``benchmark_serving``) count tokens with
``transformers.AutoTokenizer.from_pretrained(--tokenizer)``, which wants a directory with
``tokenizer.json`` and ``tokenizer_config.json``; a model served from a ``.gguf`` has neither.
:func:`write_hf_tokenizer` rebuilds the tokenizer from the file's ``tokenizer.*`` metadata (the
same :mod:`prefixkv.models.gguf_tokenizer` the engine uses, so both encode alike) and writes:

* ``tokenizer.json``: vocabulary, merges, pre-tokenizer, special tokens, BOS post-processor;
* ``tokenizer_config.json``: ``tokenizer_class`` (``PreTrainedTokenizerFast``), the BOS / EOS /
  UNK / PAD tokens, ``chat_template``, ``model_max_length`` (the GGUF's context length),
  ``add_bos_token``;
* ``special_tokens_map.json``: the same special tokens, for older ``transformers``.

The directory is written beside the target under a temporary name and renamed into place, so a
reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from prefixkv.models.gguf_file import GGUFFile
from prefixkv.models.gguf_tokenizer import build_backend

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""What a complete export holds."""


def hf_tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json`` for GGUF metadata ``meta`` (special tokens, template, length)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if tid is None or not 0 <= int(tid) < len(tokens) else str(tokens[int(tid)])

    arch = meta.get("general.architecture")
    context = meta.get(f"{arch}.context_length")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context) if context is not None else 1 << 30,
    }
    for key in ("bos", "eos", "unk", "pad"):
        value = token("unknown" if key == "unk" else "padding" if key == "pad" else key)
        if value is not None:
            config[f"{key}_token"] = value
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config


def write_hf_tokenizer(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the tokenizer of ``gguf_path`` as a Hugging Face directory at ``out_dir``.

    Replaces whatever ``out_dir`` held. ``ValueError`` for a tokenizer the GGUF reader does not
    support (see :mod:`prefixkv.models.gguf_tokenizer`). Returns ``out_dir``.
    """
    meta = GGUFFile(gguf_path).metadata
    backend = build_backend(meta)
    config = hf_tokenizer_config(meta)
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        backend.save(str(part / "tokenizer.json"))
        for name, body in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
            (part / name).write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n",
                                     encoding="utf-8")
        try:
            os.replace(part, out)
        except OSError:  # out is a non-empty directory: an older export or a concurrent writer's
            shutil.rmtree(out, ignore_errors=True)
            os.replace(part, out)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    return out


def is_complete(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` holds every file of an export."""
    return all((Path(out_dir) / name).is_file() for name in FILES)
