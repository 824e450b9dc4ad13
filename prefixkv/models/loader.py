"""Load a local Hugging Face-format model directory into :class:`LlamaForCausalLM`.

Layout read: ``config.json`` plus either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` with its shards. Nothing is downloaded. Default dtype: float32
on CPU, bfloat16 on CUDA; ``device=None`` picks CUDA when available.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from prefixkv.models.config import ModelConfig
from prefixkv.models.llama import PACKED_WEIGHTS, LlamaForCausalLM

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
# Checkpoint entries that are derived buffers in older exports, never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> ``cuda`` when available, else ``cpu``; strings are parsed by torch."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"invalid device {device!r}: {exc}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"invalid device {device!r}: CUDA is not available on this machine")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` -> float32 on CPU, bfloat16 elsewhere; accepts names like ``"bf16"``."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        key = str(dtype).removeprefix("torch.").lower()
        if key not in _DTYPES:
            raise ValueError(f"invalid dtype {dtype!r} (use one of {sorted(set(_DTYPES))})")
        resolved = _DTYPES[key]
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"invalid dtype {dtype!r}: only float32, bfloat16, float16")
    return resolved


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of ``model_dir`` (single file or sharded index), existence checked."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        with index.open(encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"model shards listed in {index} not found: {missing}")
        return files
    raise FileNotFoundError(
        f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json"
    )


def _packed_target(name: str) -> tuple[str, int | None]:
    """HF weight name -> (our parameter name, part index or None when not packed)."""
    for hf, (ours, index, _) in PACKED_WEIGHTS.items():
        if f".{hf}." in name:
            return name.replace(f".{hf}.", f".{ours}."), index
    return name, None


def _hf_names(name: str) -> list[str]:
    """Our parameter name -> the HF names it is made of (itself when not packed)."""
    parts = sorted(
        (index, hf) for hf, (ours, index, _) in PACKED_WEIGHTS.items() if f".{ours}." in name
    )
    return [name.replace(f".{PACKED_WEIGHTS[hf][0]}.", f".{hf}.") for _, hf in parts] or [name]


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, config expects {shape}")
    return tensor


def load_model(
    model_dir: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> LlamaForCausalLM:
    """Build the model from ``model_dir`` with weights on ``device`` in ``dtype``, eval mode.

    Raises ``FileNotFoundError`` for a missing directory or file and ``ValueError`` for an
    unsupported config or weights that do not match it (missing, unexpected or mis-shaped).
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    config = ModelConfig.from_file(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    files = weight_files(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}  # packed name -> part index -> tensor
    for file in files:
        for name, tensor in load_file(str(file), device=str(dev)).items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            target, index = _packed_target(name)
            if target not in expected:
                raise ValueError(f"unexpected weight {name!r} in {file} for {config.architecture}")
            if index is None:
                state[name] = _check_shape(name, tensor, expected[name]).to(dt)
            else:
                parts.setdefault(target, {})[index] = tensor.to(dt)
    for target, got in parts.items():
        names = _hf_names(target)
        if len(got) == len(names):
            packed = torch.cat([got[i] for i in range(len(names))], dim=0)
            state[target] = _check_shape(" + ".join(names), packed, expected[target])
    missing = [n for name in sorted(set(expected) - set(state)) for n in _hf_names(name)]
    missing = [
        n for n in missing if _packed_target(n)[1] not in parts.get(_packed_target(n)[0], {})
    ]
    if missing:
        raise ValueError(
            f"weights missing from {path}: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    model.load_state_dict(state, assign=True)
    return model.eval().requires_grad_(False)
