"""The built-in demo model: a small deterministic Qwen3-style model with a byte-level tokenizer.

Its weights are random (fixed torch seed), so **its text output is meaningless**: it exists so
that the engine, server and benchmarks run anywhere without downloads, and so that prefill is
costly enough (a 2,048-token prefill takes a visible fraction of a second on 2 CPU cores) for
prefix caching to show. Greedy output leans towards printable ASCII bytes (the output rows of
other bytes and of special tokens are scaled down) so that demo text is at least legible.

The files are plain Hugging Face format (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``) and are loaded through the normal loader;
``transformers`` can load them too (``AutoModelForCausalLM``), which the benchmarks use.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

DEMO_VERSION = "1"
"""Bump when the demo's config, weights or tokenizer change (the cache directory is versioned)."""
DEMO_SEED = 20240607
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "bos_token_id": None,
    "eos_token_id": [258, 256],
    "torch_dtype": "float32",
}


def default_cache_root() -> Path:
    """``$PREFIXKV_CACHE_DIR`` if set, else ``~/.cache/prefixkv``."""
    env = os.environ.get("PREFIXKV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "prefixkv"


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """Path of the demo model directory, written on first use (the model's text is meaningless).

    The directory is ``<cache_dir or default_cache_root()>/demo-<DEMO_VERSION>``. Files are
    written to a temporary sibling and renamed into place, so concurrent first uses are safe:
    whoever renames first wins, the others discard their copy.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / f"demo-{DEMO_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".demo-{DEMO_VERSION}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        write_demo_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_demo_model(model_dir: str | Path) -> None:
    """Write the demo model's files into ``model_dir`` (created if needed); deterministic."""
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2), encoding="utf-8")
    save_file(demo_weights(), str(path / "model.safetensors"), metadata={"format": "pt"})
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": DEMO_CONFIG["max_position_embeddings"],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2), encoding="utf-8")


def demo_weights() -> dict[str, torch.Tensor]:
    """The demo's state dict (HF names), from a fixed-seed generator.

    Linear weights are N(0, 1/fan_in) so every layer changes the residual stream noticeably
    (the output depends on context, not only on the last token).
    """
    c = DEMO_CONFIG
    gen = torch.Generator().manual_seed(DEMO_SEED)
    hidden, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    heads, kv_heads, vocab = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        weight: torch.Tensor = torch.randn(out_f, in_f, generator=gen) * in_f**-0.5
        return weight

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = linear(heads * d, hidden)
        w[p + "self_attn.k_proj.weight"] = linear(kv_heads * d, hidden)
        w[p + "self_attn.v_proj.weight"] = linear(kv_heads * d, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, heads * d)
        w[p + "self_attn.q_norm.weight"] = torch.ones(d)
        w[p + "self_attn.k_norm.weight"] = torch.ones(d)
        w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, inter)
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    w["model.norm.weight"] = torch.ones(hidden)
    head = linear(vocab, hidden) * 4.0
    legible = torch.full((vocab, 1), 0.3)
    legible[32:127] = 1.0  # printable ASCII
    legible[10] = 1.0  # newline
    w["lm_head.weight"] = head * legible
    return {k: v.contiguous() for k, v in w.items()}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ``ByteLevel`` expects)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: token id == byte value (0-255), then :data:`SPECIAL_TOKENS`.

    Any text round-trips (``decode(encode(s)) == s``); special tokens are matched as wholes.
    """
    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok
