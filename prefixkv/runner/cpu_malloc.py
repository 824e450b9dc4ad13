"""glibc ``malloc`` settings for a process that runs the model on CPU.

A prefill's activations are tens of megabytes a tensor (SmolLM2's 2,030-token gate/up output is
25 MB) and live for one op. With glibc's defaults (a dynamic mmap threshold starting at 128 KiB,
the heap top trimmed above 128 KiB free) many of them are mapped, faulted in page by page and
returned to the kernel again, layer after layer: on the machine measured that is 11-12% of a
2,030-token prefill (``docs/benchmarks.md``, issue 16). vLLM's CPU build avoids the same cost by
preloading its bundled tcmalloc into its workers; :func:`tune` gets it from glibc itself by
raising the mmap threshold to 512 MiB and the trim threshold to 1 GiB, so freed activations are
reused from the heap.

Process-wide and one-way (glibc has no getter to restore from), so the engine applies it only
when asked: ``build_engine`` calls :func:`tune` for a CPU model when
``EngineConfig.model.tune_malloc`` is on (the default; ``--no-tune-malloc`` on ``prefixkv
serve``). The cost is memory the heap keeps after a peak (bounded by the step's token budget),
never more than the process already touched. Not glibc (musl, macOS): nothing changes.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 512 << 20
"""Allocations below this come from the heap (the KV pool, larger, is still mapped)."""
TRIM_THRESHOLD = 1 << 30
"""Free memory at the heap top kept up to this before it is returned to the kernel."""

_tuned = False


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # pragma: no cover - platforms without dlopen(NULL)
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    return libc


def tune() -> bool:
    """Set the thresholds above for this process (once); True when glibc took them."""
    global _tuned
    if _tuned:
        return True
    libc = _glibc()
    if libc is None:
        return False
    ok: bool = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    _tuned = ok and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    return _tuned


def is_tuned() -> bool:
    """Whether :func:`tune` has taken effect in this process."""
    return _tuned
