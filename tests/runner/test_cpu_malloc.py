"""glibc malloc tuning (prefixkv/runner/cpu_malloc.py): a 64 MB activation comes from the heap
once tuned (no fresh mapping to fault in), and build_engine applies it unless told not to.
Each case runs in its own process: the setting is process-wide and cannot be undone."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

from prefixkv.runner import cpu_malloc

pytestmark = pytest.mark.skipif(
    cpu_malloc._glibc() is None or not hasattr(ctypes.CDLL(None), "mallinfo2"),
    reason="needs glibc >= 2.33 (mallinfo2)",
)

# Prints the bytes held in mmapped chunks while a 64 MB tensor is alive, minus before it.
PROBE = """
import ctypes, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
before = libc.mallinfo2().hblkhd
x = torch.empty(16 << 20)  # 64 MB, like a long prefill's gate/up output
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped_bytes(setup: str) -> int:
    code = textwrap.dedent(setup) + PROBE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_tuned_processes_serve_activations_from_the_heap():
    assert _mapped_bytes("") >= 64 << 20  # glibc's default: mapped, faulted in, unmapped
    assert _mapped_bytes("from prefixkv.runner import cpu_malloc; assert cpu_malloc.tune()") == 0


@pytest.mark.parametrize("tune", [True, False])
def test_build_engine_tunes_cpu_processes_unless_told_not_to(tune):
    setup = f"""
    from prefixkv.engine import LLM
    from prefixkv.runner import cpu_malloc
    LLM(tune_malloc={tune})
    assert cpu_malloc.is_tuned() is {tune}
    """
    mapped = _mapped_bytes(setup)
    assert (mapped == 0) if tune else (mapped >= 64 << 20)


def test_tune_is_idempotent():
    assert cpu_malloc.tune() is True  # this test process: already tuned, or tuned now
    assert cpu_malloc.tune() is True
    assert cpu_malloc.is_tuned()
