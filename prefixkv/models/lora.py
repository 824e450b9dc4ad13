"""LoRA adapters in PEFT's format, applied per token inside the decoder's matmuls.

An adapter directory holds ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``) and ``adapter_model.safetensors`` (``...layers.{i}.
{self_attn,mlp}.{q,k,v,o,gate,up,down}_proj.lora_{A,B}.weight``). :func:`load_adapter` maps it
onto this decoder's fused matmuls (q/k/v -> ``qkv_proj`` and gate/up -> ``gate_up_proj``, each a
slice of the output) with the scale folded into ``B``: a piece adds
``x @ A^T @ B^T`` to its slice of the module's output. Every rank up to ``max_rank`` and any
subset of the seven projections; DoRA, per-module rank/alpha patterns, trained biases, extra
saved modules and embedding/output-layer targets are refused (``ValueError`` naming them).

One step may mix adapters and the base model: :class:`LoRAStep` groups the batch's token rows
by adapter and :func:`applied` hangs it on the model's :class:`~prefixkv.models.llama.Linear`
modules for the step (each then adds its pieces to its own output). The runner owns that: it
builds the step from its items and holds it only while the model runs.

``LoRAAdapter.digest`` is a sha256 of the weights and scales as loaded: the prefix cache keys an
adapter's blocks by it (never by its name), so different weights under one name never share KV.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from prefixkv.models.config import ModelConfig

if TYPE_CHECKING:
    from prefixkv.models.llama import CausalLM

__all__ = ["LoRAAdapter", "LoRAPiece", "LoRAStep", "applied", "load_adapter"]

_ATTN = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_MLP = {"gate_proj": 0, "up_proj": 1}
_TARGETS = {*_ATTN, *_MLP, "o_proj", "down_proj"}


@dataclass(frozen=True, slots=True)
class LoRAPiece:
    """``a`` ``[r, in]``; ``b`` ``[stop - start, r]``, scaled: adds ``x a^T b^T`` to the output
    columns ``[start, stop)`` of its module."""

    start: int
    stop: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True, slots=True, eq=False)
class LoRAAdapter:
    """A loaded adapter: its pieces by module name (``model.layers.3.self_attn.qkv_proj``)."""

    name: str
    path: str
    rank: int
    digest: str
    pieces: dict[str, tuple[LoRAPiece, ...]]


def _read_config(path: Path, max_rank: int) -> dict[str, Any]:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"lora adapter {str(path)!r}: cannot read adapter_config.json: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora adapter {str(path)!r}: adapter_config.json is not an object")
    problems = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
    for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern",
                "fan_in_fan_out", "layers_to_transform", "trainable_token_indices"):
        if config.get(key):
            problems.append(f"{key} is set")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append("trained biases")
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        problems.append(f"r={rank!r} (1..{max_rank}, --max-lora-rank)")
    if problems:
        raise ValueError(f"lora adapter {str(path)!r} is not supported: " + "; ".join(problems))
    return config


def load_adapter(path: str | Path, model_config: ModelConfig, *, name: str, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> LoRAAdapter:
    """Load a PEFT LoRA directory for a model of ``model_config`` (``ValueError`` naming what
    does not fit: a module this decoder lacks, a shape, a layer past the model's)."""
    root = Path(path)
    config = _read_config(root, max_rank)
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    weights_file = root / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"lora adapter {str(root)!r}: no adapter_model.safetensors")
    tensors = load_file(str(weights_file))
    c = model_config
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    spans = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv),
             "gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        parts = key.split(".")
        try:
            at = parts.index("layers")
            layer, block, proj, which = int(parts[at + 1]), parts[at + 2], parts[at + 3], parts[at + 4]
        except (ValueError, IndexError):
            raise ValueError(f"lora adapter {str(root)!r}: tensor {key!r} targets no decoder "
                             "layer projection (embeddings and the output layer are not supported)") from None
        if proj not in _TARGETS or which not in ("lora_A", "lora_B") or not 0 <= layer < c.num_hidden_layers:
            raise ValueError(f"lora adapter {str(root)!r}: tensor {key!r} does not fit this model")
        pairs.setdefault((layer, block, proj), {})[which] = tensor
    pieces: dict[str, list[LoRAPiece]] = {}
    digest = hashlib.sha256(f"r={rank};scale={scale!r}".encode())
    for (layer, block, proj), ab in sorted(pairs.items()):
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if a is None or b is None:
            raise ValueError(f"lora adapter {str(root)!r}: layer {layer} {proj} lacks lora_A or lora_B")
        fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                 "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}.get(proj, proj)
        start, stop = spans.get(proj, (0, b.shape[0]))
        inputs = {"o_proj": q, "down_proj": inter}.get(proj, c.hidden_size)
        if a.shape != (rank, inputs) or b.shape != (stop - start, rank):
            raise ValueError(f"lora adapter {str(root)!r}: layer {layer} {proj} has shapes "
                             f"{tuple(a.shape)} / {tuple(b.shape)}, expected "
                             f"{(rank, inputs)} / {(stop - start, rank)}")
        for t in (a, b):
            digest.update(t.float().contiguous().numpy().tobytes())
        pieces.setdefault(f"model.layers.{layer}.{block}.{fused}", []).append(LoRAPiece(
            start, stop, a.to(device=device, dtype=dtype).contiguous(),
            (b.float() * scale).to(device=device, dtype=dtype).contiguous()))
    if not pieces:
        raise ValueError(f"lora adapter {str(root)!r} has no LoRA weights")
    return LoRAAdapter(name, str(root), rank, digest.hexdigest(),
                       {k: tuple(v) for k, v in pieces.items()})


class LoRAStep:
    """The adapters of one step's flat token batch: ``spans[i] = (adapter or None, n_tokens)``
    in batch order. Row groups are index tensors, or slices when an adapter's rows are one run."""

    def __init__(self, spans: Sequence[tuple[LoRAAdapter | None, int]],
                 device: torch.device | str = "cpu") -> None:
        rows: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        offset = 0
        for adapter, n in spans:
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(range(offset, offset + n))
            offset += n
        self.groups: list[tuple[LoRAAdapter, slice | torch.Tensor]] = []
        for adapter, ids in rows.values():
            run = ids[-1] - ids[0] + 1 == len(ids)
            self.groups.append((adapter, slice(ids[0], ids[-1] + 1) if run
                                else torch.tensor(ids, dtype=torch.long, device=device)))

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (module ``name``'s output for ``x``) with every group's pieces added in place."""
        for adapter, rows in self.groups:
            pieces = adapter.pieces.get(name)
            if not pieces:
                continue
            xs = x[rows]
            for p in pieces:
                delta = (xs @ p.a.t()) @ p.b.t()
                if isinstance(rows, slice):
                    y[rows, p.start:p.stop] += delta
                else:
                    y[:, p.start:p.stop].index_add_(0, rows, delta)
        return y


@contextmanager
def applied(model: CausalLM, step: LoRAStep) -> Iterator[None]:
    """Hang ``step`` on every :class:`~prefixkv.models.llama.Linear` that one of its adapters
    targets, for the duration of the block (the model then adds the deltas in its forward)."""
    from prefixkv.models.llama import Linear

    names = {n for adapter, _ in step.groups for n in adapter.pieces}
    hooked: list[Linear] = []
    for name, module in model.named_modules():
        if name in names and isinstance(module, Linear):
            module.lora = (step, name)
            hooked.append(module)
    if len(hooked) != len(names):  # e.g. 4-bit GGUF matmuls: never run the base model silently
        for module in hooked:
            module.lora = None
        raise ValueError("this model's matmuls cannot take LoRA adapters (quantized weights?)")
    try:
        yield
    finally:
        for module in hooked:
            module.lora = None
