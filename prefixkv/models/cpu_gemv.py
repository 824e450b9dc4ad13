"""Decode-row matmuls on oneDNN-packed float32 or bfloat16 weights, in C (``_cpu_gemv.c``).

A decode step multiplies one row (or a few) by every weight of the model, so its time is the
time to stream the weights from memory. oneDNN's matmul on a packed weight streams them at
about 80% of the bandwidth a plain AVX-512 loop reaches on this shape; prefill stays on
oneDNN (compute-bound there, where it is near peak). The loop reads the packed weight where
it lies, so no second copy of any weight is kept.

``setup.py`` builds ``prefixkv.models._cpu_gemv`` where a C compiler with OpenMP is present.
:func:`readable` decides once per packed weight (its size must be oneDNN's ``[N/64][K][64]``
float32 layout or ``[N/64][K/2][64][2]`` bfloat16 one, and the C product must equal oneDNN's
bit for bit, summing the inputs in oneDNN's blocks, so the rows of a step give the same
values whichever path computes them); :func:`gemv` returns ``None`` wherever the C path does
not fit (more than :data:`MAX_ROWS` rows, another dtype than the weight's, an odd stride, the
extension not built, the switch off) and the caller (``cpu_pack.py``) runs oneDNN.
``PREFIXKV_CPU_GEMV=0`` turns the C path off for the process.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    from prefixkv.models import _cpu_gemv as _ext
except ImportError:  # no compiler (or no OpenMP) at install time
    _ext = None  # type: ignore[assignment]

BUILT = _ext is not None and _ext.supported()
"""The extension is built and this CPU runs it (x86-64 with AVX-512F/DQ)."""

BUILT_BF16 = BUILT and _ext.supported_bf16()
"""... and its bfloat16 form (AVX512_BF16)."""

ENABLED = BUILT and os.environ.get("PREFIXKV_CPU_GEMV", "1") != "0"
"""Whether decode rows take the C path where it fits."""

MAX_ROWS = 32
"""Most rows of ``x`` the C path takes (a decode batch); more rows (prefill chunks) are
oneDNN's. Decode steps measured 1.06-1.11x faster than oneDNN's at 8-32 rows."""

BLOCK = 64
"""Outputs per block of oneDNN's packed layouts: float32 ``[N / 64][K][64]``, bfloat16
``[N / 64][K / 2][64][2]`` (pairs of inputs side by side)."""

_F32, _BF16 = torch.float32, torch.bfloat16
_CHECK_TOL = {_F32: 1e-4, _BF16: 2e-2}
"""Allowed relative max error of oneDNN's product against ``F.linear`` on the probe."""


K_BLOCKS = (512, 1024, 256, 2048)
"""Input-block sizes tried for a weight's sum after oneDNN's rule (all K up to 512 inputs, 512
up to 1,024, 1,024 above: measured on float32 and bfloat16 weights) and all of K."""


def readable(
    packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[int, int]:
    """``(address, k_block)`` when :func:`gemv` can read ``packed`` (oneDNN's copy of the plain
    ``[N, K]`` ``weight``) and give oneDNN's floats exactly; ``(0, 0)`` otherwise.

    The packed buffer must be exactly ``ceil(N / 64) * 64 * K`` values of the weight's dtype
    (float32, or bfloat16 with an even ``K`` on a CPU with AVX512_BF16: the layouts this path
    reads; any other size, e.g. a padded ``K``, is refused before a read). oneDNN sums the
    inputs in blocks (512 or 1,024 of them, by K, on the CPUs measured); the first block size
    whose C product of a 64-row probe (in calls of 1, 5, 32 and 26 rows) equals oneDNN's
    product bit for bit is kept, so a token's result does not depend on how many rows its
    step had (a cached prefix leaves few). No size matching: refused, oneDNN keeps every row
    count. (In bfloat16 the output's rounding hides most of the sums' last bits, so a wrong
    size can pass a small probe: oneDNN's rule is tried first.)
    """
    dtype = weight.dtype
    ok_dtype = dtype == _F32 or (dtype == _BF16 and BUILT_BF16 and weight.shape[-1] % 2 == 0)
    if not (ENABLED and ok_dtype and weight.dim() == 2 and packed.is_mkldnn):
        return 0, 0
    n, k = weight.shape
    size = 4 if dtype == _F32 else 2
    if torch.ops.mkldnn._nbytes(packed) != -(-n // BLOCK) * BLOCK * k * size:
        return 0, 0
    address: int = torch.ops.mkldnn.data_ptr(packed)
    gen = torch.Generator().manual_seed(k)
    probe = torch.randn(2 * MAX_ROWS, k, generator=gen).to(dtype)
    b = None if bias is None else bias.detach()
    with torch.inference_mode():
        onednn = torch.ops.mkldnn._linear_pointwise(probe, packed, b, "none", [], "")
        want = F.linear(probe.float(), weight.detach().float(), None if b is None else b.float())
        scale = want.abs().max().item() or 1.0
        if (onednn.float() - want).abs().max().item() > _CHECK_TOL[dtype] * scale:
            return 0, 0
        rule = k if k <= 512 else 512 if k <= 1024 else 1024  # oneDNN's, where measured
        for kb in dict.fromkeys((rule, k, *(s for s in K_BLOCKS if s < k))):
            if dtype == _BF16 and kb % 2:
                continue
            got = [gemv(probe[r : r + rows], address, n, k, kb, dtype, b)
                   for r, rows in ((0, 1), (1, 5), (6, MAX_ROWS), (6 + MAX_ROWS, MAX_ROWS - 6))]
            parts = [g for g in got if g is not None]
            if len(parts) == len(got) and torch.equal(torch.cat(parts), onednn):
                return address, kb
    return 0, 0


def gemv(
    x: torch.Tensor, address: int, n: int, k: int, k_block: int, dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """``x W^T (+ bias)`` for a 2-D ``x`` ``[rows, k]`` of at most :data:`MAX_ROWS` rows and
    the packed ``[n, k]`` weight of ``dtype`` (float32 or bfloat16) at ``address``, summed in
    blocks of ``k_block`` inputs (both from :func:`readable`); a new ``[rows, n]`` tensor, or
    ``None`` (fall back: nothing was computed; an ``x`` of another dtype or width is oneDNN's
    to report)."""
    if not (ENABLED and address and k_block > 0 and x.dtype is dtype and x.is_cpu and x.dim() == 2):
        return None
    if not (dtype is _F32 or (dtype is _BF16 and BUILT_BF16 and k_block % 2 == 0)):
        return None
    rows, width = x.shape
    x_stride, unit = x.stride()
    if rows > 1 and x_stride < k:  # one row: its stride is never read
        return None
    if not 0 < rows <= MAX_ROWS or unit != 1 or width != k:
        return None
    if bias is not None and not (bias.dtype is dtype and bias.is_contiguous()):
        return None
    out = torch.empty((rows, n), dtype=dtype)
    _ext.gemv(address, n, k, k_block, x.data_ptr(), x_stride if rows > 1 else k, out.data_ptr(), n,
              0 if bias is None else bias.data_ptr(), rows, torch.get_num_threads(),
              dtype is _BF16)
    return out
