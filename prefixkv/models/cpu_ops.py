"""The decoder's elementwise steps fused in C on CPU (``_cpu_ops.c``), or ``None`` to fall back.

``setup.py`` builds ``prefixkv.models._cpu_ops`` where a C compiler with OpenMP is present.
Each function here returns ``None`` when its inputs do not fit the C path (not float32, not on
CPU, an odd stride or width, the extension not built, an older CPU, or the switch off); the
caller (``llama.py``) then runs the plain torch expression. Results match torch's to float32
rounding (one pass instead of several; RMSNorm sums its squares in a different order).

Why: at decode (one row) torch's RMSNorm is six dispatched ops, about 17 us where one C call
takes 2-3 us; at prefill the fused passes save memory traffic (``docs/benchmarks.md``,
issue 16). ``PREFIXKV_CPU_OPS=0`` turns the C path off for the process; ``ENABLED`` is the
same switch for code and tests.
"""

from __future__ import annotations

import os

import torch

try:
    from prefixkv.models import _cpu_ops as _ops
except ImportError:  # no compiler (or no OpenMP) at install time
    _ops = None  # type: ignore[assignment]

BUILT = _ops is not None and _ops.supported()
"""The extension is built and this CPU runs it (x86-64 with AVX-512F/DQ)."""

ENABLED = BUILT and os.environ.get("PREFIXKV_CPU_OPS", "1") != "0"
"""Whether the fused C path is taken where it fits."""


def _fits(x: torch.Tensor, width: int) -> bool:
    return (
        ENABLED
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() >= 2
        and x.stride(-1) == 1
        and width % 16 == 0
        and width >= 16
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension of a 2-D ``x``, after
    ``x += residual`` in place when a residual is given; a new tensor, or ``None`` (fall back:
    nothing was changed)."""
    dim = x.shape[-1]
    if not (_fits(x, dim) and x.dim() == 2 and weight.dtype == torch.float32
            and weight.is_contiguous() and weight.shape == (dim,)):
        return None
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1
    ):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    _ops.rms_norm(
        x.data_ptr(), x.stride(0),
        0 if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
        out.data_ptr(), out.stride(0), weight.data_ptr(), x.shape[0], dim, eps,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The RMSNorm of each head of ``x`` ``[T, H, D]`` (heads adjacent in a row: Qwen3's q/k
    norms on a view of the fused qkv output), the same row function as :func:`rms_norm`; a new
    contiguous tensor, or ``None`` (fall back)."""
    dim = x.shape[-1]
    if not (_fits(x, dim) and x.dim() == 3 and x.stride(1) == dim and weight.dtype == torch.float32
            and weight.is_contiguous() and weight.shape == (dim,) and x.shape[0] > 0):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    _ops.rms_norm(x.data_ptr(), x.stride(0), 0, 0, out.data_ptr(), out.stride(0),
                  weight.data_ptr(), x.shape[0], dim, eps, torch.get_num_threads(), x.shape[1])
    return out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor | None:
    """``silu(gate) * up`` of 2-D ``gate_up`` rows ``[gate | up]`` (``inter`` each); a new
    ``[rows, inter]`` tensor, or ``None`` (fall back)."""
    if not (_fits(gate_up, inter) and gate_up.dim() == 2 and gate_up.shape[1] == 2 * inter):
        return None
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype)
    _ops.silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0),
                  gate_up.shape[0], inter, torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """HF's RoPE applied in place to ``x`` ``[T, H, D]`` (heads adjacent in a row) with
    ``cos`` / ``sin`` ``[T, 1, D]`` (halves equal); returns ``x``, or ``None`` (fall back:
    ``x`` unchanged)."""
    t, heads, dim = x.shape
    if not (_fits(x, dim) and dim % 32 == 0 and x.stride(1) == dim
            and cos.shape == sin.shape == (t, 1, dim) and cos.dtype == sin.dtype == torch.float32
            and cos.is_contiguous() and sin.is_contiguous()):
        return None
    _ops.rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), dim, t, heads, dim,
              torch.get_num_threads())
    return x


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(cos, sin)`` ``[T, 1, 2 * half]`` float32 of ``positions`` ``[T]`` (int64) times
    ``inv_freq`` ``[half]`` (float32; ``half`` a multiple of 16), halves equal, as
    ``cat(freqs, freqs).cos()`` / ``.sin()``; each value correctly rounded (torch's float32 cos may
    differ by one ulp). ``None``: fall back."""
    half = inv_freq.shape[0]
    if not (ENABLED and positions.device.type == "cpu" and positions.dtype == torch.int64
            and positions.dim() == 1 and positions.is_contiguous()
            and inv_freq.device.type == "cpu" and inv_freq.dtype == torch.float32
            and inv_freq.dim() == 1 and inv_freq.is_contiguous() and half % 16 == 0 and half):
        return None
    t = positions.shape[0]
    cos = torch.empty((t, 1, 2 * half), dtype=torch.float32)
    sin = torch.empty((t, 1, 2 * half), dtype=torch.float32)
    _ops.rope_cos_sin(positions.data_ptr(), t, inv_freq.data_ptr(), half, cos.data_ptr(),
                      sin.data_ptr(), torch.get_num_threads())
    return cos, sin
