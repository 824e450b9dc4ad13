"""A PEFT adapter written as llama.cpp's GGUF LoRA, the way its ``convert_lora_to_gguf.py``
does it (a test helper at the tests root, so every test folder imports it; the reader under
test is ``prefixkv/models/lora_gguf.py``).

Names come from the ``gguf`` package's own tensor map (``gguf.get_tensor_name_map``, what the
converter uses), not from prefixkv's; for Llama, ``lora_b`` of q and k gets the converter's
row permutation (``LlamaModel.permute`` applied to ``B`` only: ``W + s B A`` keeps its rows'
order when ``B``'s rows move); ``general.type`` adapter, ``adapter.type`` lora and
``adapter.lora.alpha`` as the converter writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

import gguf


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute`` on the rows of ``w``."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_lora(adapter: Path, out: Path, arch: str, layers: int, *, heads: int = 0,
                    kv_heads: int = 0, qtype: str = "F32") -> Path:
    """Write the PEFT ``adapter`` directory as a GGUF LoRA for ``arch`` (``"qwen3"``,
    ``"llama"``: then q/k ``lora_b`` rows are permuted for ``heads`` / ``kv_heads``) at
    ``out``; tensors as ``qtype`` (F32, F16 or Q8_0)."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    kind = gguf.GGMLQuantizationType[qtype]
    for key, tensor in sorted(load_file(str(adapter / "adapter_model.safetensors")).items()):
        hf = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
        hf = hf.replace(".lora_B.weight", ".weight")
        name = names.get_name(hf, try_suffixes=(".weight",))
        assert name is not None, key
        value = tensor.float().numpy()
        if ".lora_B." in key and arch == "llama" and (".q_proj." in key or ".k_proj." in key):
            value = llama_permute(value, heads if ".q_proj." in key else kv_heads)
        suffix = ".lora_a" if ".lora_A." in key else ".lora_b"
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name + suffix, np.ascontiguousarray(value))
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name + suffix, value.astype(np.float16))
        else:
            writer.add_tensor(name + suffix, gguf.quants.quantize(value, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
