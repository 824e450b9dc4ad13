"""The built-in demo model: deterministic, cached once, loads through the normal loader."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from prefixkv.models import ModelConfig, Tokenizer, ensure_demo_model, load_model
from prefixkv.models.demo import DEMO_VERSION, write_demo_model
from prefixkv.models.llama import LlamaForCausalLM


def digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_two_fresh_writes_are_identical(tmp_path):
    write_demo_model(tmp_path / "a")
    write_demo_model(tmp_path / "b")
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    assert set(digest(tmp_path / "a")) == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_ensure_writes_once_under_env_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXKV_CACHE_DIR", str(tmp_path))
    path = ensure_demo_model()
    assert path == tmp_path / f"demo-{DEMO_VERSION}"
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp dirs left behind


def test_loads_with_sane_shapes_and_logits(tmp_path):
    path = ensure_demo_model(tmp_path)
    cfg = ModelConfig.from_file(path)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm
    assert cfg.max_position_embeddings >= 8192
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    tok = Tokenizer.from_dir(path)
    assert tok.vocab_size == cfg.vocab_size
    model = load_model(path, device="cpu")
    assert isinstance(model, LlamaForCausalLM)
    ids = torch.tensor(tok.encode("The quick brown fox"))
    pos = torch.arange(len(ids))

    def dense(layer, q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return o.transpose(0, 1)

    with torch.inference_mode():
        logits = model.compute_logits(model(ids, pos, dense))
    assert logits.shape == (len(ids), cfg.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std() > 1.0  # not degenerate
    assert len(set(logits.argmax(-1).tolist())) > 1  # next token depends on the input


def test_concurrent_first_uses_agree(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: ensure_demo_model(tmp_path), range(3)))
    assert len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]
    fresh = tmp_path / "fresh"
    write_demo_model(fresh)
    assert digest(paths[0]) == digest(fresh)
