"""Llama-family decoder (Llama, Qwen2, Qwen3) over a flat batch of tokens.

The model owns weights only; it never holds KV state. Tokens of all sequences in a step are
concatenated into one flat ``[T]`` batch ("varlen" layout). Attention is delegated to the
``attention`` callable passed to :meth:`LlamaForCausalLM.forward` — the runner's paged-KV
context for the current step — so there is no global attention metadata and this module
imports nothing from the runner.

Parameter names mirror Hugging Face (``model.layers.N.self_attn.o_proj.weight`` ...), except
that q/k/v and gate/up projections are packed into one matmul each (``qkv_proj``,
``gate_up_proj``); :data:`PACKED_WEIGHTS` tells the loader how HF tensors map onto them. The
maths mirrors ``transformers`` (RMSNorm in float32, RoPE cos/sin in float32 cast to the
activation dtype), so logits match it to fp32 tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from prefixkv.models import cpu_ops
from prefixkv.models.config import ModelConfig
from prefixkv.models.cpu_pack import PackedWeight, pack_weight, packed_linear

if TYPE_CHECKING:
    from prefixkv.models.lora import LoRAStep

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attention(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> out [T, Hq, D]``.

q and k arrive with RoPE applied. The callable stores k/v wherever it keeps its cache.
"""


class CausalLM(Protocol):
    """What the loader and the runner need from a model class (a registry family builds one).

    ``__call__(input_ids [T], positions [T], attention) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]``; ``pack_weights()`` prepares the
    matmul weights for the device once after loading; the rest is ``nn.Module``'s.
    """

    config: ModelConfig

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def pack_weights(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...


PACKED_WEIGHTS: dict[str, tuple[str, int, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0, 3),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1, 3),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2, 3),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2),
    "mlp.up_proj": ("mlp.gate_up_proj", 1, 2),
}
"""HF module name -> (our packed module, part index, number of parts); parts concatenate on dim 0."""


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like ``transformers``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:  # same products, one pass fewer
            fused = (cpu_ops.rms_norm(x, self.weight, self.eps) if x.dim() == 2 else
                     cpu_ops.rms_norm_heads(x, self.weight, self.eps) if x.dim() == 3 else None)
            if fused is not None:
                return fused
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``x += residual`` (in place: ``x`` becomes the residual stream), then the norm of
        ``x``; one pass in C where it fits (``cpu_ops.py``)."""
        if x.dtype == self.weight.dtype == torch.float32:
            fused = cpu_ops.rms_norm(x, self.weight, self.eps, residual)
            if fused is not None:
                return fused
        out: torch.Tensor = self(x.add_(residual))
        return out


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies ``[head_dim // 2]`` (float32, CPU), llama3 scaling applied."""
    dim = config.head_dim
    inv = 1.0 / (
        config.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    )
    s = config.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (HF's RoPE) for ``x`` ``[T, H, D]``: in place in C
    where ``cpu_ops.rope_`` fits (float32 CPU), as a new tensor otherwise.

    The halves of ``cos``/``sin`` are equal (``cat(freqs, freqs)``), so the rotation is two
    half-width products subtracted / added in place: the same roundings as HF's expression
    (``a + (-b) * s == a - b * s`` exactly) without its negated and concatenated copies.
    """
    if x.dim() == 3 and cpu_ops.rope_(x, cos, sin) is not None:
        return x  # rotated in place, in C (cpu_ops.py)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    sin_half = sin[..., :half]
    out = x * cos
    out[..., :half].sub_(x2 * sin_half)
    out[..., half:].add_(x1 * sin_half)
    return out


class Linear(nn.Module):
    """``y = x W^T (+ b)``; parameters are allocated uninitialised (the loader fills them).

    Unlike ``nn.Linear`` there is no random init, so building a model costs nothing before
    its weights are loaded. :meth:`pack` replaces the weight by a oneDNN-packed copy (CPU) that
    the forward then uses (see :mod:`prefixkv.models.cpu_pack`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: PackedWeight | None = None  # a plain attribute: never in the state dict
        self.lora: tuple[LoRAStep, str] | None = None  # this step's adapters (models/lora.py)

    def pack(self) -> bool:
        """Pack the loaded weight for the CPU matmul; ``False`` when it stays on ``F.linear``.

        Once packed, the packed copy is the only resident one: ``weight`` becomes a ``meta``
        parameter (same name, shape and dtype in the state dict, no data), so the matmul
        weights are held once. Take anything that reads the values (the model fingerprint)
        before packing; a packed layer cannot be loaded again.
        """
        if self.packed is not None:
            return True
        self.packed = pack_weight(self.weight, self.bias)
        if self.packed is None:
            return False
        self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (packed_linear(x, self.packed, self.bias) if self.packed is not None
             else F.linear(x, self.weight, self.bias))
        if self.lora is not None:
            step, name = self.lora
            return step.apply(name, x, y)
        return y


class Embedding(nn.Module):
    """Token embedding table ``[vocab, hidden]``, allocated uninitialised like :class:`Linear`."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Attention(nn.Module):
    """Self-attention projections (+ Qwen3 q/k norm); the KV-cache work is ``attention``'s."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        hidden = config.hidden_size
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        # q_proj, k_proj and v_proj packed into one matmul (see PACKED_WEIGHTS).
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.num_heads * d, hidden, bias=config.o_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        # q and k side by side [T, Hq + Hkv, D]: one RoPE pass rotates both
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, d)
        if self.q_norm is not None and self.k_norm is not None:
            h = self.num_heads
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, d)
        out = attention(self.layer_idx, q, k, v)
        result: torch.Tensor = self.o_proj(out.reshape(t, self.num_heads * d))
        return result


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        # gate_proj and up_proj packed into one matmul (see PACKED_WEIGHTS).
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = cpu_ops.silu_mul(gate_up, self.intermediate_size)  # one pass in C where it fits
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate).mul_(up)
        result: torch.Tensor = self.down_proj(act)
        return result


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then SwiGLU, each with a residual."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        # the sublayers' outputs are fresh tensors: the residual is added into them in place
        h = self.self_attn(self.input_layernorm(x), cos, sin, attention)
        normed = self.post_attention_layernorm.add_forward(h, x)  # h += x, then its norm
        result: torch.Tensor = self.mlp(normed).add_(h)
        return result


class DecoderModel(nn.Module):
    """Embeddings, layers and final norm (HF's ``model.*`` namespace)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Causal LM for Llama / Qwen2 / Qwen3 configs; stateless apart from its weights.

    ``lm_head`` exists only when embeddings are not tied; with tied embeddings the logits use
    ``model.embed_tokens.weight``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # A plain attribute, not a buffer: it is derived from the config, never loaded.
        self._inv_freq = rope_inv_freq(config)
        self._logits_packed: PackedWeight | None = None  # tied embeddings: see pack_weights

    def pack_weights(self) -> int:
        """Pack every matmul weight for the CPU (:mod:`prefixkv.models.cpu_pack`), the output
        layer included, dropping the plain copies (:meth:`Linear.pack`). A tied embedding is
        the exception: lookups need the plain table, so the output layer gets a packed copy
        beside it (``vocab x hidden`` extra). Call once after loading, after anything that
        reads weight values; returns how many weights were packed (0 off CPU)."""
        count = sum(m.pack() for m in self.modules() if isinstance(m, Linear))
        if self.lm_head is None:
            self._logits_packed = pack_weight(self.model.embed_tokens.weight)
            count += self._logits_packed is not None
        return count

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` shaped ``[T, 1, head_dim]`` for absolute ``positions`` ``[T]``."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        fused = cpu_ops.rope_cos_sin(positions, self._inv_freq)
        if fused is not None:  # one C pass (torch: five ops, 0.86 ms for 2,080 positions)
            return fused[0].to(dtype), fused[1].to(dtype)
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` for flat ``input_ids`` / ``positions`` ``[T]``."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        result: torch.Tensor = self.model.norm(x)
        return result

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` (model dtype) for hidden states ``[N, hidden]``."""
        if self.lm_head is not None:
            logits: torch.Tensor = self.lm_head(hidden)
            return logits
        if self._logits_packed is not None:
            return packed_linear(hidden, self._logits_packed, None)
        return F.linear(hidden, self.model.embed_tokens.weight)
