"""Fixtures every test directory shares: whether this machine should have built the optional C
extensions (a C compiler; an AVX-512 x86-64 CPU for the compute ones). A test that asks for one
is skipped where the answer is no, so "built where it can run" assertions fail only on a build
that silently did not happen."""

from __future__ import annotations

import platform
import shutil
import sysconfig

import pytest


@pytest.fixture
def c_compiler() -> None:
    """Skip unless a C compiler is on PATH (``pip install -e .`` then builds the extensions)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not (shutil.which(cc) or shutil.which("gcc")):
        pytest.skip("no C compiler here: the optional C extensions are not built")


@pytest.fixture
def avx512_cpu() -> None:
    """Skip unless this is an x86-64 CPU with AVX-512F and DQ (what the compute kernels need)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        flags = ""
    if platform.machine() != "x86_64" or " avx512f" not in flags or " avx512dq" not in flags:
        pytest.skip("not an AVX-512 x86-64 CPU: the torch paths run")


@pytest.fixture
def gemv_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip unless the C decode matmul is built and reads oneDNN's packed float32 layout on this
    machine (``cpu_gemv.readable``: the layout is oneDNN's choice per CPU; where it differs the
    weights stay on oneDNN, which the other tests cover). Turns the C path on for the test."""
    import torch

    from prefixkv.models import cpu_gemv
    from prefixkv.models.cpu_pack import pack_weight

    if not cpu_gemv.BUILT:
        pytest.skip("the C decode matmul is not built here (no compiler / no AVX-512)")
    monkeypatch.setattr(cpu_gemv, "ENABLED", True)
    packed = pack_weight(torch.randn(128, 64))
    if packed is None or not packed.address:
        pytest.skip("oneDNN packs float32 weights in another layout on this CPU")
