"""Prepacked CPU matmul weights (oneDNN), the layout peers use for CPU inference.

``torch``'s default ``F.linear`` on CPU multiplies by a row-major ``[out, in]`` weight through
MKL's transposed GEMM, which reads the weight at about half the memory bandwidth for one
decode row and is 2x slower than needed for a batch of 8. oneDNN reorders the weight once
into its blocked layout (what inductor's CPU ``freezing`` and vLLM's CPU build do), after
which ``torch.ops.mkldnn._linear_pointwise`` runs near bandwidth at batch 1 and
compute-bound for prefill; with bfloat16 weights it uses the CPU's avx512_bf16 / AMX units.

Ownership: a packed :class:`~prefixkv.models.llama.Linear` holds its weight once, as the
:class:`PackedWeight` in its plain ``packed`` attribute; its ``weight`` parameter becomes a
``meta`` tensor (name, shape and dtype stay in the state dict; no data), so packing does not
double the weight memory. Whatever reads weight values (the runner's model fingerprint) runs
before packing. Packing is CPU-only and checked once per weight against ``F.linear``; when oneDNN is
missing or disagrees, that weight keeps its plain tensor and stays on ``F.linear``. oneDNN's
per-shape primitive caches are capped before the first weight is packed
(:func:`bound_shape_caches`), so a server's memory does not grow with every new step size.

Decode rows (at most ``cpu_gemv.MAX_ROWS``) of a float32 or bfloat16 weight go to a C loop
that reads the same packed buffer (``cpu_gemv.py``: oneDNN reaches about 80% of the memory
bandwidth there); the buffer's address is kept beside the tensor that owns it, in one
:class:`PackedWeight`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixkv.models import cpu_gemv

SHAPE_CACHE_CAPACITY = 64
"""Entries kept by each of oneDNN's per-shape caches (ideep's ``LRU_CACHE_CAPACITY`` and oneDNN's
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; both default to 1,024). A matmul of a new row count creates
(JIT-compiles) a primitive that these caches keep, about 0.3-0.55 MB each, and a server's
prefill steps come in every row count up to the step budget: with the defaults a server's RSS
crept up by ~45 MB a thousand requests toward a ~1 GB plateau (``docs/reliability.md``). The
layers of one step share their weights' shapes, so only a step's first layer misses the cache."""
SHAPE_CACHE_VARS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
"""The environment variables read (once, at the process's first oneDNN matmul) for those caps."""

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


@dataclass(frozen=True)
class PackedWeight:
    """A weight in oneDNN's layout: ``tensor`` owns the buffer; ``address`` is its data for the
    C decode loop (``cpu_gemv``), 0 where that loop cannot read it, ``k_block`` the input
    block its sums run in (oneDNN's); the weight is ``[out_features, in_features]``."""

    tensor: torch.Tensor
    address: int
    k_block: int
    out_features: int
    in_features: int


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a weight packed by :func:`pack_weight`: decode rows
    through the C loop where it fits, oneDNN otherwise."""
    if packed.address:
        few = cpu_gemv.gemv(x, packed.address, packed.out_features, packed.in_features,
                            packed.k_block, packed.tensor.dtype, bias)
        if few is not None:
            return few
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")
    return out


def bound_shape_caches() -> dict[str, str]:
    """Cap oneDNN's per-shape caches at :data:`SHAPE_CACHE_CAPACITY` entries unless the
    environment already sets them; returns the settings in effect. The libraries read them at
    the process's first oneDNN matmul, so this runs before the first weight is packed (a process
    that ran one earlier keeps what it read then)."""
    for name in SHAPE_CACHE_VARS:
        os.environ.setdefault(name, str(SHAPE_CACHE_CAPACITY))
    return {name: os.environ[name] for name in SHAPE_CACHE_VARS}


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """oneDNN-packed copy of a 2-D ``[out, in]`` CPU weight, or ``None`` when it cannot be used.

    The copy is verified on a probe input against ``F.linear``; a failure or mismatch returns
    ``None`` (the caller keeps ``F.linear``), so packing never changes what a layer computes
    beyond rounding.
    """
    if weight.dim() != 2 or not packing_available(weight.device, weight.dtype):
        return None
    bound_shape_caches()
    with torch.inference_mode():
        try:
            tensor: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach(), PACK_BATCH_HINT
            )
            probe = torch.linspace(-1.0, 1.0, 3 * weight.shape[1], dtype=torch.float32)
            probe = probe.view(3, -1).to(weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, tensor, bias, "none", [], "").float()
        except RuntimeError:
            return None
        want = F.linear(probe.float(), weight.float(), None if bias is None else bias.float())
    scale = want.abs().max().item() or 1.0
    if (got - want).abs().max().item() > _CHECK_TOL[weight.dtype] * scale:
        return None
    address, k_block = cpu_gemv.readable(tensor, weight, bias)
    return PackedWeight(tensor, address, k_block, weight.shape[0], weight.shape[1])
