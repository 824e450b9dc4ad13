"""Load a local model into its registry family's class: an HF directory or a GGUF file.

HF layout read: ``config.json`` plus either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` with its shards. A path ending in ``.gguf`` goes to
:mod:`prefixkv.models.gguf_loader` (weights dequantized to ``dtype``). Nothing is downloaded.
Default dtype: float32 on CPU, bfloat16 on CUDA; ``device=None`` picks CUDA when available.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file

from prefixkv.models.config import ModelConfig
from prefixkv.models.llama import PACKED_WEIGHTS, CausalLM
from prefixkv.models.registry import family_for
from prefixkv.models.tokenizer import Tokenizer

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


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix)."""
    return Path(path).suffix.lower() == ".gguf"


def load_model(
    model_path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = None,
) -> CausalLM:
    """Build the model at ``model_path`` (HF directory or ``.gguf`` file) on ``device`` in ``dtype``.

    ``quantization="gguf"`` keeps a GGUF file's Q4_0/Q4_1 matmul weights at 4 bits (see
    :func:`~prefixkv.models.gguf_loader.load_gguf_model`); ``None`` dequantizes everything.
    Raises ``FileNotFoundError`` for a missing directory or file and ``ValueError`` for an
    unsupported config, weights that do not match it (missing, unexpected or mis-shaped) or
    a ``quantization`` the model cannot use.
    """
    path = Path(model_path)
    if is_gguf(path):
        from prefixkv.models.gguf_loader import load_gguf_model

        return load_gguf_model(path, device=device, dtype=dtype, quantization=quantization)
    if quantization is not None:
        raise ValueError(f"quantization={quantization!r} needs a .gguf model, got {path}")
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    config = ModelConfig.from_file(path)
    dev = resolve_device(device)

    def tensors() -> Iterable[tuple[str, torch.Tensor]]:
        for file in weight_files(path):
            yield from load_file(str(file), device=str(dev)).items()

    return build_model(config, tensors(), device=dev, dtype=dtype, source=str(path))


def load_tokenizer(model_path: str | Path) -> Tokenizer:
    """The tokenizer of an HF directory or of a GGUF file's metadata."""
    if is_gguf(model_path):
        from prefixkv.models.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(model_path)
    return Tokenizer.from_dir(model_path)


def build_model(
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    device: torch.device,
    dtype: str | torch.dtype | None,
    source: str,
) -> CausalLM:
    """The family's model for ``config`` with ``tensors`` (HF names) loaded, eval mode.

    Packs q/k/v and gate/up parts, checks every shape against the config and reports missing
    or unexpected weights (naming ``source``) as ``ValueError``.
    """
    dt = resolve_dtype(dtype, device)
    family = family_for(architecture=config.architecture)
    with torch.device("meta"):
        model = family.build(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}  # packed name -> part index -> tensor
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target, index = _packed_target(name)
        if target not in expected:
            raise ValueError(f"unexpected weight {name!r} in {source} for {config.architecture}")
        if index is None:
            checked = _check_shape(name, tensor, expected[name])
            # A meta tensor is a placeholder for a weight the caller attaches after loading
            # (GGUF weights kept quantized): it stays meta, holding no data.
            state[name] = checked if checked.is_meta else checked.to(device, dt)
        else:
            parts.setdefault(target, {})[index] = tensor.to(device, dt)
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
            f"weights missing from {source}: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    model.load_state_dict(state, assign=True)
    module: torch.nn.Module = model  # type: ignore[assignment]
    module.eval().requires_grad_(False)
    return model
