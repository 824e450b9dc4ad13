"""Decode-row matmuls on oneDNN-packed float32 weights, in C (``_cpu_gemv.c``), or ``None``.

A decode step multiplies one row (or a few) by every weight of the model, so its time is the
time to stream the weights from memory. oneDNN's matmul on a packed weight streams them at
about 80% of the bandwidth a plain AVX-512 loop reaches on this shape; prefill stays on
oneDNN (compute-bound there, where it is near peak). The loop reads the packed weight where
it lies, so no second copy of any weight is kept.

``setup.py`` builds ``prefixkv.models._cpu_gemv`` where a C compiler with OpenMP is present.
:func:`usable` decides once per packed weight (its size must be oneDNN's ``[N/64][K][64]``
float32 layout, and a probe product must match ``F.linear``); :func:`gemv` returns ``None``
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


def packed_address(packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Address of ``packed``'s data when :func:`gemv` can read it as ``weight`` (the plain
    ``[N, K]`` tensor it was packed from), else 0.

    The packed buffer must be exactly ``ceil(N / 64) * 64 * K`` float32 values (the layout
    this path reads; any other size, e.g. a padded ``K``, is refused before a read), and the
    C product of a probe input must match ``F.linear`` on the plain weight.
    """
    if not (ENABLED and weight.dtype == torch.float32 and weight.dim() == 2 and packed.is_mkldnn):
        return 0
    n, k = weight.shape
    if torch.ops.mkldnn._nbytes(packed) != -(-n // BLOCK) * BLOCK * k * 4:
        return 0
    address: int = torch.ops.mkldnn.data_ptr(packed)
    probe = torch.linspace(-1.0, 1.0, 5 * k, dtype=torch.float32).view(5, k)
    probe = probe * torch.linspace(0.5, 1.5, k)  # no two columns alike
    with torch.inference_mode():
        want = F.linear(probe, weight.detach(), None if bias is None else bias.detach())
        for rows in (1, 5):  # one pass of four rows and a second one
            got = gemv(probe[:rows], address, n, k, bias)
            scale = want.abs().max().item() or 1.0
            if got is None or (got - want[:rows]).abs().max().item() > _CHECK_TOL * scale:
                return 0
    return address


def gemv(
    x: torch.Tensor, address: int, n: int, k: int, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``x W^T (+ bias)`` for a 2-D float32 ``x`` ``[rows, k]`` of at most :data:`MAX_ROWS`
    rows and the packed ``[n, k]`` weight at ``address`` (from :func:`packed_address`); a new
    ``[rows, n]`` tensor, or ``None`` (fall back: nothing was computed; a wrong width is
    oneDNN's to report)."""
    if not (ENABLED and address and x.dtype is _F32 and x.is_cpu and x.dim() == 2):
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
    _ext.gemv(address, n, k, x.data_ptr(), x_stride if rows > 1 else k, out.data_ptr(), n,
              0 if bias is None else bias.data_ptr(), rows, torch.get_num_threads())
    return out
