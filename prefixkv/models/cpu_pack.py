"""Prepacked CPU matmul weights (oneDNN), the layout peers use for CPU inference.

``torch``'s default ``F.linear`` on CPU multiplies by a row-major ``[out, in]`` weight through
MKL's transposed GEMM, which reads the weight at about half the memory bandwidth for one
decode row and is 2x slower than needed for a batch of 8. oneDNN reorders the weight once
into its blocked layout (what inductor's CPU ``freezing`` and vLLM's CPU build do), after
which ``torch.ops.mkldnn._linear_pointwise`` runs near bandwidth at batch 1 and
compute-bound for prefill; with bfloat16 weights it uses the CPU's avx512_bf16 / AMX units.

Ownership: a packed :class:`~prefixkv.models.llama.Linear` holds its weight once, as the
packed copy in its plain ``packed`` attribute; its ``weight`` parameter becomes a ``meta``
tensor (name, shape and dtype stay in the state dict; no data), so packing does not double
the weight memory. Whatever reads weight values (the runner's model fingerprint) runs before
packing. Packing is CPU-only and checked once per weight against ``F.linear``; when oneDNN is
missing or disagrees, that weight keeps its plain tensor and stays on ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 8
"""Batch size oneDNN tunes the blocked layout for (any batch is accepted)."""
_CHECK_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}
"""Allowed relative max error of a packed matmul against ``F.linear`` on a probe input."""


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` on ``device`` can be packed (CPU, oneDNN, fp32/bf16)."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a weight packed by :func:`pack_weight`."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """oneDNN-packed copy of a 2-D ``[out, in]`` CPU weight, or ``None`` when it cannot be used.

    The copy is verified on a probe input against ``F.linear``; a failure or mismatch returns
    ``None`` (the caller keeps ``F.linear``), so packing never changes what a layer computes
    beyond rounding.
    """
    if weight.dim() != 2 or not packing_available(weight.device, weight.dtype):
        return None
    with torch.inference_mode():
        try:
            packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach(), PACK_BATCH_HINT
            )
            probe = torch.linspace(-1.0, 1.0, 3 * weight.shape[1], dtype=torch.float32)
            probe = probe.view(3, -1).to(weight.dtype)
            got = packed_linear(probe, packed, bias).float()
        except RuntimeError:
            return None
        want = F.linear(probe.float(), weight.float(), None if bias is None else bias.float())
    scale = want.abs().max().item() or 1.0
    if (got - want).abs().max().item() > _CHECK_TOL[weight.dtype] * scale:
        return None
    return packed
