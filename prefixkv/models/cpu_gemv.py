"""Decode-row matmuls on oneDNN-packed float32 weights, in C (``_cpu_gemv.c``), or ``None``.

A decode step multiplies one row (or a few) by every weight of the model, so its time is the
time to stream the weights from memory. oneDNN's matmul on a packed weight streams them at
about 80% of the bandwidth a plain AVX-512 loop reaches on this shape; prefill stays on
oneDNN (compute-bound there, where it is near peak). The loop reads the packed weight where
it lies, so no second copy of any weight is kept.

``setup.py`` builds ``prefixkv.models._cpu_gemv`` where a C compiler with OpenMP is present.
:func:`readable` decides once per packed weight (its size must be oneDNN's ``[N/64][K][64]``
float32 layout, and the C product must equal oneDNN's bit for bit, summing the inputs in
oneDNN's blocks, so the rows of a step give the same floats whichever path computes them);
:func:`gemv` returns ``None``
wherever the C path does not fit (more than :data:`MAX_ROWS` rows, not float32, an odd
stride, the extension not built, the switch off) and the caller (``cpu_pack.py``) runs
oneDNN. ``PREFIXKV_CPU_GEMV=0`` turns the C path off for the process.
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

ENABLED = BUILT and os.environ.get("PREFIXKV_CPU_GEMV", "1") != "0"
"""Whether decode rows take the C path where it fits."""

MAX_ROWS = 32
"""Most rows of ``x`` the C path takes (a decode batch); more rows (prefill chunks) are
oneDNN's. Decode steps measured 1.06-1.11x faster than oneDNN's at 8-32 rows."""

BLOCK = 64
"""Outputs per block of oneDNN's packed float32 layout ``[N / 64][K][64]``."""

_F32 = torch.float32
_CHECK_TOL = 1e-4
"""Allowed relative max error of the C product against ``F.linear`` on the probe."""


K_BLOCKS = (512, 1024, 256, 2048)
"""Input-block sizes tried, in order, for a weight's sum (besides all of K in one block)."""


def readable(
    packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[int, int]:
    """``(address, k_block)`` when :func:`gemv` can read ``packed`` (oneDNN's copy of the plain
    ``[N, K]`` ``weight``) and give oneDNN's floats exactly; ``(0, 0)`` otherwise.

    The packed buffer must be exactly ``ceil(N / 64) * 64 * K`` float32 values (the layout
    this path reads; any other size, e.g. a padded ``K``, is refused before a read). oneDNN
    sums the inputs in blocks (512 or 1,024 of them, by K, on the CPUs measured); the first
    block size whose C product of a probe equals oneDNN's many-row product bit for bit is
    kept, so a token's result does not depend on how many rows its step had (a cached prefix
    leaves few). No size matching: refused, oneDNN keeps every row count.
    """
    if not (ENABLED and weight.dtype == torch.float32 and weight.dim() == 2 and packed.is_mkldnn):
        return 0, 0
    n, k = weight.shape
    if torch.ops.mkldnn._nbytes(packed) != -(-n // BLOCK) * BLOCK * k * 4:
        return 0, 0
    address: int = torch.ops.mkldnn.data_ptr(packed)
    probe = torch.linspace(-1.0, 1.0, 64 * k, dtype=torch.float32).view(64, k)
    probe = probe * torch.linspace(0.5, 1.5, k)  # no two columns alike
    b = None if bias is None else bias.detach()
    with torch.inference_mode():
        onednn = torch.ops.mkldnn._linear_pointwise(probe, packed, b, "none", [], "")
        want = F.linear(probe, weight.detach(), b)
        scale = want.abs().max().item() or 1.0
        if (onednn - want).abs().max().item() > _CHECK_TOL * scale:
            return 0, 0
        for kb in (k, *(size for size in K_BLOCKS if size < k)):
            got = [gemv(probe[:rows], address, n, k, kb, b) for rows in (1, 5)]
            if all(g is not None and torch.equal(g, onednn[: g.shape[0]]) for g in got):
                return address, kb
    return 0, 0


def gemv(
    x: torch.Tensor, address: int, n: int, k: int, k_block: int, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``x W^T (+ bias)`` for a 2-D float32 ``x`` ``[rows, k]`` of at most :data:`MAX_ROWS`
    rows and the packed ``[n, k]`` weight at ``address``, summed in blocks of ``k_block``
    inputs (both from :func:`readable`); a new ``[rows, n]`` tensor, or ``None`` (fall back:
    nothing was computed; a wrong width is oneDNN's to report)."""
    if not (ENABLED and address and k_block > 0 and x.dtype is _F32 and x.is_cpu and x.dim() == 2):
        return None
    rows, width = x.shape
    x_stride, unit = x.stride()
    if rows > 1 and x_stride < k:  # one row: its stride is never read
        return None
    if not 0 < rows <= MAX_ROWS or unit != 1 or width != k:
        return None
    if bias is not None and not (bias.dtype is _F32 and bias.is_contiguous()):
        return None
    out = torch.empty((rows, n), dtype=torch.float32)
    _ext.gemv(address, n, k, k_block, x.data_ptr(), x_stride if rows > 1 else k, out.data_ptr(), n,
              0 if bias is None else bias.data_ptr(), rows, torch.get_num_threads())
    return out
