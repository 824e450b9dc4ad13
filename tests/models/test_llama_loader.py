"""Loader: single and sharded safetensors, dtype/device resolution, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixkv.models import ensure_demo_model, load_model, resolve_device, resolve_dtype
from prefixkv.models.llama import LlamaForCausalLM


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


def test_demo_loads_float32_on_cpu(demo_dir):
    model = load_model(demo_dir, device="cpu")
    assert isinstance(model, LlamaForCausalLM)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    assert not any(p.is_meta for p in model.parameters())


def test_sharded_index_gives_identical_weights(demo_dir, tmp_path):
    state = load_file(str(demo_dir / "model.safetensors"))
    names = sorted(state)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(demo_dir / "config.json", tmp_path / "config.json")
    a, b = load_model(demo_dir, device="cpu"), load_model(tmp_path, device="cpu")
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(ta, tb)


def test_dtype_override(demo_dir):
    model = load_model(demo_dir, device="cpu", dtype="bf16")
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="invalid dtype 'int8'"):
        resolve_dtype("int8", torch.device("cpu"))


def test_missing_directory_and_files(tmp_path, demo_dir):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    shutil.copy(demo_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-1.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="model-1.safetensors"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path, demo_dir):
    cfg = json.loads((demo_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        load_model(tmp_path)


def test_weights_that_do_not_match_the_config(tmp_path, demo_dir):
    shutil.copy(demo_dir / "config.json", tmp_path / "config.json")
    state = load_file(str(demo_dir / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="weights missing.*lm_head.weight"):
        load_model(tmp_path)
    state["lm_head.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight.*shape"):
        load_model(tmp_path)
    state["lm_head.weight"] = torch.zeros(259, 256)
    state["model.extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
        load_model(tmp_path)


def test_missing_part_of_a_packed_projection_is_named(tmp_path, demo_dir):
    shutil.copy(demo_dir / "config.json", tmp_path / "config.json")
    state = load_file(str(demo_dir / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="weights missing") as err:
        load_model(tmp_path)
    assert "'model.layers.1.self_attn.k_proj.weight'" in str(err.value)
    assert "'model.layers.2.mlp.up_proj.weight'" in str(err.value)
    assert "q_proj" not in str(err.value) and "gate_proj" not in str(err.value)


def test_device_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="invalid device 'nonsense'"):
        resolve_device("nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
