"""The optional C attention kernel for CPU (``_cpu_attn.c``).

``setup.py`` builds ``prefixkv.runner._cpu_attn`` where a C compiler with OpenMP is present.
One call computes a whole step's causal attention, prefill chunks and decodes alike, over the
paged pool *in place* (through each sequence's block ids: no gathered context, no padding, no
mask tensor): a flash-attention loop for AVX-512 CPUs, float32 arithmetic on float32 or
bfloat16 tensors, on torch's own OpenMP threads (its ``libgomp`` is loaded first, so the
extension shares that runtime and never oversubscribes the cores). On the machine measured it
runs SmolLM2's 2,030-token causal prefill attention about 2.5x faster than torch's CPU flash
kernel (``docs/benchmarks.md``, issue 16).

:func:`usable` says whether a pool can take it: the module built, an AVX-512 CPU, a contiguous
float32 or bfloat16 CPU pool, a head size that is a multiple of 16 up to 256. Anything else
keeps torch's SDPA (``attention.py``). :func:`batch` turns a step's sequences into the
kernel's arrays once (checking every id against the pool), :func:`attend` runs one layer.
``PREFIXKV_CPU_ATTENTION=0`` in the environment turns the kernel off for the process (A/B runs,
debugging); ``ENABLED`` is the same switch for code and tests, ``DECODES`` keeps decodes on
the torch path when False.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

try:
    from prefixkv.runner import _cpu_attn as _kernel
except ImportError:  # no compiler (or no OpenMP) at install time: SDPA everywhere
    _kernel = None  # type: ignore[assignment]

BUILT = _kernel is not None and _kernel.supported()
"""The extension is built and this CPU runs it (x86-64 with AVX-512F/DQ)."""

ENABLED = BUILT and os.environ.get("PREFIXKV_CPU_ATTENTION", "1") != "0"
"""Whether steps take the kernel (when :func:`usable`); tests and benchmarks flip it."""

DECODES = True
"""Decodes take the kernel too (reading their context in place: no gather, no padding; a
group sharing a long cached prefix as well: 1.24-1.36x the torch path's single read of it).
False keeps them on the torch paths (``attention.py``), for A/B runs and their tests."""

_MAX_DIM = 256
_DTYPES = (torch.float32, torch.bfloat16)


def usable(kv: torch.Tensor, head_dim: int) -> bool:
    """Whether attention over the pool tensor ``kv`` (``KVPool.kv``: contiguous, heads of
    ``head_dim`` innermost) can run in the kernel (module docstring); False keeps torch."""
    return (
        ENABLED
        and kv.device.type == "cpu"
        and kv.dtype in _DTYPES
        and kv.is_contiguous()
        and head_dim % 16 == 0
        and head_dim <= _MAX_DIM
    )


@dataclass(frozen=True, slots=True)
class Batch:
    """A step's sequences for :func:`attend`, built once per step by :func:`batch` (plain int64
    arrays, read by address: no torch op per step)."""

    info: array[int]  # int64, 4 per sequence: first row, queries, start position, offset in tables
    tables: array[int]  # int64: every sequence's block ids, one after another
    rows: int  # rows of q / out the sequences cover
    num_blocks: int  # the pool's block count the ids were checked against


def batch(
    seqs: Sequence[tuple[int, int, int, Sequence[int]]], block_size: int, num_blocks: int
) -> Batch:
    """``seqs``: per sequence ``(first row, queries, start position, block ids)``; its queries
    are rows ``first row ..`` of q at positions ``start ..``, and its ids cover ``[0, start +
    queries)``. ``ValueError`` for anything the kernel could not read safely."""
    info: list[int] = []
    ids: list[int] = []
    rows = 0
    for row, n, start, blocks in seqs:
        if row < 0 or n < 1 or start < 0:
            raise ValueError(f"bad sequence (row {row}, queries {n}, start {start})")
        need = -(-(start + n) // block_size)
        if len(blocks) < need:
            raise ValueError(f"{len(blocks)} blocks cover {len(blocks) * block_size} positions, "
                             f"need {start + n}")
        info += (row, n, start, len(ids))
        ids.extend(blocks[:need])
        rows = max(rows, row + n)
    if not info:
        raise ValueError("no sequences")
    if ids and not 0 <= min(ids) <= max(ids) < num_blocks:
        raise ValueError(f"block ids must be in [0, {num_blocks})")
    return Batch(array("q", info), array("q", ids), rows, num_blocks)


def attend(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, b: Batch
) -> None:
    """Write into ``out`` ``[T, Hq, D]`` the causal attention of each sequence of ``b`` (its
    queries' rows of ``q`` ``[T, Hq, D]``) over the keys/values ``[0, start + queries)`` of the
    pool ``k_cache`` / ``v_cache`` ``[N, bs, Hkv, D]``, read through its block ids; scale ``D **
    -0.5``. Rows no sequence covers are left as they are.

    The caller has checked :func:`usable` and written every position's K/V
    (``PagedAttention`` does both); shapes and strides are checked here, since the kernel
    reads raw addresses.
    """
    if q.stride(2) != 1:
        q = q.contiguous()
    check(out, q, k_cache, v_cache, b)
    bind(out, q, k_cache, b, torch.get_num_threads())(k_cache.data_ptr(), v_cache.data_ptr())


def check(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, b: Batch
) -> None:
    """``ValueError`` unless :func:`bind`'s kernel call may read ``q`` and ``b``'s blocks of the
    pool and write ``out`` (the shapes, strides and dtypes :func:`attend` documents). It holds
    for every layer of a pool whose ``(k, v)`` views share ``k_cache``'s shape and strides
    (``KVPool``)."""
    check_layout(out, q, k_cache, v_cache)
    if b.rows > q.shape[0] or b.num_blocks != k_cache.shape[0]:
        raise ValueError(f"the batch covers {b.rows} rows of {b.num_blocks} blocks; q has "
                         f"{q.shape[0]} rows, the pool {k_cache.shape[0]} blocks")


def check_layout(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """:func:`check` without a batch: what holds for any step over these tensors (a caller
    that keeps them checks it once, then each batch's rows and pool size itself)."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    if q.stride(2) != 1:
        raise ValueError("q's head dimension must be contiguous")
    if heads % kv_heads or k_cache.shape[3] != d or k_cache.stride(2) != d or k_cache.stride(3) != 1:
        raise ValueError(f"q {tuple(q.shape)} does not fit the pool {tuple(k_cache.shape)}")
    dtype = k_cache.dtype
    if dtype not in _DTYPES or q.dtype != dtype:
        raise ValueError(f"q and the pool must be float32 or bfloat16 alike: {q.dtype}, {dtype}")
    if out.shape != q.shape or out.stride(2) != 1 or out.dtype != dtype:
        raise ValueError(f"out must be a {dtype} {tuple(q.shape)} tensor, got {tuple(out.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")


def bind(
    out: torch.Tensor, q: torch.Tensor, pool_layer: torch.Tensor, b: Batch, threads: int
) -> Callable[[int, int], None]:
    """The kernel on ``q`` / ``out`` for one layer at a time: ``f(k_addr, v_addr)`` runs it on
    the layer whose K / V views (shaped and strided like ``pool_layer``) start there. Everything
    else is read once, here (the per-step decode path binds once per step and calls it per
    layer). No checks: only after :func:`check` passed for the same shapes, strides and dtypes."""
    kernel = _kernel.attend
    q_addr, q_st, q_sh = q.data_ptr(), q.stride(0), q.stride(1)
    o_addr, o_st, o_sh = out.data_ptr(), out.stride(0), out.stride(1)
    blk_st, tok_st = pool_layer.stride(0), pool_layer.stride(1)
    info, n_seqs, tables = b.info.buffer_info()[0], len(b.info) // 4, b.tables.buffer_info()[0]
    heads, kv_heads, dim, bs = q.shape[1], pool_layer.shape[2], q.shape[2], pool_layer.shape[1]
    scale, bf16 = dim**-0.5, pool_layer.dtype == torch.bfloat16

    def run(k_addr: int, v_addr: int) -> None:
        kernel(q_addr, q_st, q_sh, o_addr, o_st, o_sh, k_addr, v_addr, blk_st, tok_st, info,
               n_seqs, tables, heads, kv_heads, dim, bs, scale, threads, bf16)

    return run


def prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: Sequence[int] | torch.Tensor,
    start: int,
) -> None:
    """One sequence: :func:`attend` for queries ``q`` ``[n, Hq, D]`` at positions ``start ..``
    over blocks ``table``, into ``out``."""
    ids = table.tolist() if isinstance(table, torch.Tensor) else list(table)
    attend(out, q, k_cache, v_cache,
           batch([(0, q.shape[0], start, ids)], k_cache.shape[1], k_cache.shape[0]))
