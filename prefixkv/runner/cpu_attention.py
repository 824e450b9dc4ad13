"""The optional C kernel for causal prefill attention on CPU (``_cpu_attn.c``).

``setup.py`` builds ``prefixkv.runner._cpu_attn`` where a C compiler with OpenMP is present. It
computes one prefill chunk's attention (float32 arithmetic; float32 or bfloat16 tensors) over
the paged pool *in place* (through the
block table: no gathered context, no mask tensor), as a flash-attention loop for AVX-512 CPUs,
on torch's own OpenMP threads (its ``libgomp`` is loaded first, so the extension shares that
runtime and never oversubscribes the cores). On the machines measured it runs SmolLM2's
2,030-token causal prefill attention about 2.5x faster than torch's CPU flash kernel
(``docs/benchmarks.md``, issue 16).

:func:`usable` says whether a pool's prefills can take it: the module built, an AVX-512 CPU, a
contiguous float32 or bfloat16 CPU pool, a head size that is a multiple of 16 up to 256.
Anything else keeps torch's SDPA (``attention.py``).
``PREFIXKV_CPU_ATTENTION=0`` in the environment turns the kernel off for the process (A/B runs,
debugging); ``ENABLED`` is the same switch for code and tests.
"""

from __future__ import annotations

import os

import torch

try:
    from prefixkv.runner import _cpu_attn as _kernel
except ImportError:  # no compiler (or no OpenMP) at install time: SDPA everywhere
    _kernel = None  # type: ignore[assignment]

BUILT = _kernel is not None and _kernel.supported()
"""The extension is built and this CPU runs it (x86-64 with AVX-512F/DQ)."""

ENABLED = BUILT and os.environ.get("PREFIXKV_CPU_ATTENTION", "1") != "0"
"""Whether prefill chunks take the kernel (when :func:`usable`); tests and benchmarks flip it."""

_MAX_DIM = 256
_DTYPES = (torch.float32, torch.bfloat16)


def usable(kv: torch.Tensor, head_dim: int) -> bool:
    """Whether prefill chunks over the pool tensor ``kv`` (``KVPool.kv``: contiguous, heads of
    ``head_dim`` innermost) can run in the kernel (module docstring); False keeps SDPA."""
    return (
        ENABLED
        and kv.device.type == "cpu"
        and kv.dtype in _DTYPES
        and kv.is_contiguous()
        and head_dim % 16 == 0
        and head_dim <= _MAX_DIM
    )


def prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    start: int,
) -> None:
    """Write into ``out`` ``[n, Hq, D]`` the causal attention of queries ``q`` ``[n, Hq, D]``
    (positions ``start .. start + n - 1``) over keys/values ``[0, start + n)`` of the pool
    ``k_cache`` / ``v_cache`` ``[N, bs, Hkv, D]`` read through ``table`` (int64 block ids,
    ``ceil((start + n) / bs)`` of them), scale ``D ** -0.5``.

    The caller has checked :func:`usable` and guarantees the table's ids are in range and its
    positions' K/V already written (``PagedAttention`` does both). Shapes and strides are
    checked here, since the kernel reads raw addresses.
    """
    n, heads, d = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q.stride(2) != 1:
        q = q.contiguous()
    if heads % kv_heads or k_cache.shape[3] != d or k_cache.stride(2) != d or k_cache.stride(3) != 1:
        raise ValueError(f"q {tuple(q.shape)} does not fit the pool {tuple(k_cache.shape)}")
    dtype = k_cache.dtype
    if dtype not in _DTYPES or q.dtype != dtype:
        raise ValueError(f"q and the pool must be float32 or bfloat16 alike: {q.dtype}, {dtype}")
    if out.shape != q.shape or out.stride(2) != 1 or out.dtype != dtype:
        raise ValueError(f"out must be a {dtype} {tuple(q.shape)} tensor, got {tuple(out.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if table.dtype != torch.int64 or not table.is_contiguous():
        raise ValueError("table must be a contiguous int64 tensor")
    if table.numel() * bs < start + n:
        raise ValueError(f"table covers {table.numel() * bs} positions, needs {start + n}")
    _kernel.prefill(
        q.data_ptr(), q.stride(0), q.stride(1),
        out.data_ptr(), out.stride(0), out.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        table.data_ptr(), n, start, heads, kv_heads, d, bs, d**-0.5, torch.get_num_threads(),
        dtype == torch.bfloat16,
    )  # fmt: skip
