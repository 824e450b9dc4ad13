"""Int4Linear: GGUF Q4_0 / Q4_1 bytes (made by ``gguf.quants.quantize``) decoded exactly and
multiplied by torch's int4 CPU kernel within bfloat16 rounding of dequantize + ``F.linear``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from prefixkv.models.quant_linear import (
    COMPUTE_DTYPE,
    Int4Linear,
    decode_q4,
    int4_unsupported,
)

Q4 = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]
REL_TOL = 1.5e-2
"""Allowed max |error| over max |reference output|: the kernel runs in bfloat16 (8 significant
bits for activations, scales, zeros and the output; one rounding is 2^-9 = 0.2%)."""


def _raw(rows: int, cols: int, qtype: object, seed: int = 0, shift: float = 0.3) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) + shift
    return np.asarray(gguf.quants.quantize(w, qtype))


def _reference(raw: np.ndarray, qtype: object) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.float() - want).abs().max().item()
    assert err <= REL_TOL * want.abs().max().item(), err


@pytest.mark.parametrize("qtype", Q4, ids=lambda t: t.name)
def test_decode_is_exactly_ggufs_dequantize(qtype: object) -> None:
    raw = _raw(48, 96, qtype)
    rows = decode_q4(int(qtype), raw)  # type: ignore[call-overload]
    assert rows.q.shape == (48, 96) and int(rows.q.max()) <= 15
    assert torch.equal(rows.dequantize(), _reference(raw, qtype))


@pytest.mark.parametrize("qtype", Q4, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 8, 70])
def test_linear_matches_dequantize_then_f_linear(qtype: object, batch: int) -> None:
    raw = _raw(64, 128, qtype, seed=batch)
    layer = Int4Linear.from_rows([decode_q4(int(qtype), raw)])  # type: ignore[call-overload]
    x = torch.randn(batch, 128, generator=torch.Generator().manual_seed(batch))
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (batch, 64)
    _close(y, F.linear(x, _reference(raw, qtype)))
    yb = layer(x.to(torch.bfloat16))  # the output keeps the input's dtype
    assert yb.dtype == torch.bfloat16
    _close(yb, F.linear(x, _reference(raw, qtype)))


def test_fused_parts_concatenate_along_rows_with_bias_and_any_leading_shape() -> None:
    t0, t1 = Q4
    a, b = _raw(32, 64, t0, seed=1), _raw(16, 64, t1, seed=2)
    bias = torch.randn(48)
    layer = Int4Linear.from_rows([decode_q4(int(t0), a), decode_q4(int(t1), b)], bias)
    weight = torch.cat((_reference(a, t0), _reference(b, t1)))
    x = torch.randn(2, 3, 64)
    y = layer(x)
    assert y.shape == (2, 3, 48)
    _close(y, F.linear(x, weight, bias))
    assert set(layer.state_dict()) == {"qweight", "scales_zeros", "bias"}
    assert layer.scales_zeros.shape == (2, 48, 2) and layer.scales_zeros.dtype == COMPUTE_DTYPE


def test_what_cannot_stay_at_four_bits() -> None:
    cpu = torch.device("cpu")
    assert int4_unsupported(int(Q4[1]), (64, 128), cpu) is None
    assert "no exact CPU kernel" in str(int4_unsupported(int(gguf.GGMLQuantizationType.Q8_0), (64, 128), cpu))
    assert "rows % 16" in str(int4_unsupported(int(Q4[0]), (300, 128), cpu))
    assert "CPU-only" in str(int4_unsupported(int(Q4[0]), (64, 128), torch.device("cuda")))
    with pytest.raises(ValueError, match="not Q4_0 or Q4_1"):
        decode_q4(int(gguf.GGMLQuantizationType.Q8_0), np.zeros((2, 34), np.uint8))
    with pytest.raises(ValueError, match="whole Q4_1 blocks"):
        decode_q4(int(Q4[1]), np.zeros((2, 21), np.uint8))


def test_kernel_facts_the_module_relies_on() -> None:
    """Scales must have the activations' dtype (so the layer casts both to bfloat16), and the
    kernel's zero point convention is ``(q - 8) * scale + zero`` (checked by the tests above)."""
    q = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    with pytest.raises(RuntimeError, match="expected scalar type"):
        torch.ops.aten._weight_int4pack_mm_for_cpu(
            torch.randn(1, 64, dtype=torch.bfloat16), packed, 32, torch.ones(2, 16, 2)
        )
