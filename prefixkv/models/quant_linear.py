"""GGUF Q4_0 / Q4_1 matmul weights kept at 4 bits on the CPU (torch's int4 weight-only matmul).

GGUF stores these types as blocks of 32 weights along a row (the input dimension): Q4_0 is
an fp16 scale ``d`` and 16 bytes of nibbles, ``x = d * (q - 8)``; Q4_1 adds an fp16 minimum
``m``, ``x = d * q + m``. Nibble ``j`` of a block is the low half of byte ``j`` for ``j < 16``,
the high half of byte ``j - 16`` otherwise (``gguf.quants`` and ggml agree).

torch's CPU kernel ``aten._weight_int4pack_mm_for_cpu`` computes ``x @ W^T`` with
``W = (q - 8) * scale + zero`` per group of 32 input columns, ``q`` in 0..15 packed by
``aten._convert_weight_to_int4pack_for_cpu``. Both GGUF types map onto it exactly:
Q4_0 -> ``scale = d, zero = 0``; Q4_1 -> ``scale = d, zero = m + 8 d``.

Kernel facts (torch 2.13, x86 AVX-512; checked by ``tests/models/test_quant_linear.py``):
scales and zeros must have the activations' dtype; bfloat16 activations take the fast
AVX-512 path, float32 and float16 a reference path 10-100x slower than a float32 oneDNN
matmul. So :class:`Int4Linear` computes in bfloat16 (activations and the fp16 scales/zeros
rounded to bfloat16: 8 significant bits, a weight moves by at most ~2^-9 of its group's range
plus its zero's rounding) and returns the input's dtype; the rest of the model keeps the
engine dtype. Shapes: rows a multiple of 16, columns a multiple of 32. CPU only.

Memory: half a byte per weight plus 4 bytes (bf16 scale and zero) per 32 weights, i.e.
0.625 bytes per weight against 4 for float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

GROUP = 32
"""Weights per GGUF Q4 block and per kernel group (along the input dimension)."""
Q4_TYPES = {2: "Q4_0", 3: "Q4_1"}
"""ggml type id -> name of the types kept at 4 bits."""
_BLOCK_BYTES = {2: 18, 3: 20}
_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs rows % 16 == 0
COMPUTE_DTYPE = torch.bfloat16
"""The activations' dtype inside the kernel (the only fast one on CPU)."""


def int4_unsupported(tensor_type: int, shape: tuple[int, ...], device: torch.device) -> str | None:
    """Why a ``[rows, cols]`` GGUF tensor cannot be kept at 4 bits here, or ``None`` if it can."""
    if device.type != "cpu":
        return f"the int4 kernel is CPU-only (device {device})"
    if tensor_type not in Q4_TYPES:
        return "no exact CPU kernel for this type"
    if len(shape) != 2 or shape[0] % _ROW_MULTIPLE or shape[1] % GROUP:
        return f"shape {shape}: needs rows % {_ROW_MULTIPLE} == 0 and columns % {GROUP} == 0"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "this torch has no _weight_int4pack_mm_for_cpu"
    return None


@dataclass(slots=True, frozen=True)
class Q4Rows:
    """Decoded Q4 rows: ``q`` uint8 ``[rows, cols]`` in 0..15, ``scale`` and ``zero`` float32
    ``[rows, cols // 32]``, so that ``weight = (q - 8) * scale + zero`` group by group."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[rows, cols]`` these rows stand for."""
        rows, cols = self.q.shape
        w = (self.q.view(rows, -1, GROUP).float() - 8.0) * self.scale[..., None] + self.zero[..., None]
        return w.view(rows, cols)


def decode_q4(tensor_type: int, raw: np.ndarray) -> Q4Rows:
    """Decode GGUF Q4_0 / Q4_1 bytes ``raw`` (uint8 ``[rows, bytes per row]``) into :class:`Q4Rows`.

    ``ValueError`` for another type or a byte count that is not whole blocks.
    """
    if tensor_type not in Q4_TYPES:
        raise ValueError(f"decode_q4: ggml type {tensor_type} is not Q4_0 or Q4_1")
    size = _BLOCK_BYTES[tensor_type]
    rows, nbytes = raw.shape
    if nbytes % size:
        raise ValueError(f"decode_q4: {nbytes} bytes per row is not whole {Q4_TYPES[tensor_type]} blocks")
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, nbytes // size, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if tensor_type == 3:  # Q4_1: d, m, nibbles
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero, nib = m + np.float32(8.0) * d, blocks[..., 4:]
    else:  # Q4_0: d, nibbles
        zero, nib = np.zeros_like(d), blocks[..., 2:]
    q = np.concatenate((nib & 0x0F, nib >> 4), axis=-1).reshape(rows, -1)
    return Q4Rows(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


class Int4Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` held as packed int4 plus bfloat16 scales and zeros.

    Built from decoded GGUF rows (:meth:`from_rows`); fused projections pass their parts in
    output-row order (q, k, v), which concatenate along rows because groups run along the
    input dimension. Buffers ``qweight`` (packed, kernel layout) and ``scales_zeros``
    (``[cols // 32, rows, 2]``) are in the state dict, so the model fingerprint sees them.
    """

    def __init__(
        self, qweight: torch.Tensor, scales_zeros: torch.Tensor, in_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = scales_zeros.shape[1]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales_zeros", scales_zeros)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_rows(cls, parts: list[Q4Rows], bias: torch.Tensor | None = None) -> Int4Linear:
        """One layer from the decoded rows of its parts (concatenated along output rows)."""
        q = torch.cat([p.q for p in parts]) if len(parts) > 1 else parts[0].q
        scale = torch.cat([p.scale for p in parts]).to(COMPUTE_DTYPE)
        zero = torch.cat([p.zero for p in parts]).to(COMPUTE_DTYPE)
        qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        scales_zeros = torch.stack((scale.t(), zero.t()), dim=-1).contiguous()
        return cls(qweight, scales_zeros, q.shape[1], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.qweight, GROUP, self.scales_zeros
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{GROUP}"
