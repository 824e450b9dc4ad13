"""The C decode-row matmul on oneDNN-packed weights (prefixkv/models/_cpu_gemv.c) against
F.linear, what it refuses, and the model's decode with it on and off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from prefixkv.models import cpu_gemv
from prefixkv.models.cpu_pack import pack_weight, packed_linear, packing_available

needs_gemv = pytest.mark.skipif(
    not (cpu_gemv.BUILT and packing_available(torch.device("cpu"), torch.float32)),
    reason="C gemv not built / no AVX-512 / no oneDNN",
)


@pytest.fixture
def gemv_on(gemv_layout: None) -> None:
    """The C path on (whatever PREFIXKV_CPU_GEMV says for the test process), on a machine
    where it reads oneDNN's layout (``gemv_layout`` in tests/conftest.py skips otherwise)."""


def test_gemv_is_built_where_it_can_run(c_compiler, avx512_cpu):
    assert cpu_gemv.BUILT, "the C gemv was not built: run `pip install -e .`"


@needs_gemv
@pytest.mark.parametrize("n,k", [(960, 576), (100, 48), (70, 16), (576, 1536), (3, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 32])  # 4-row passes: 1, 2 and 8
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_f_linear(n, k, rows, threads, with_bias, gemv_on):
    """Every output (the last block's padding included), every row count of the C path, bias,
    one thread and the team."""
    gen = torch.Generator().manual_seed(n * k + rows)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    packed = pack_weight(weight, bias)
    assert packed is not None and packed.address, "this layout should be readable"
    x = torch.randn(rows, k, generator=gen)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_gemv.gemv(x, packed.address, n, k, packed.k_block, torch.float32, bias)
    finally:
        torch.set_num_threads(saved)
    assert got is not None and got.shape == (rows, n)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(packed_linear(x, packed, bias), got, atol=0, rtol=0)  # C path


@needs_gemv
@pytest.mark.parametrize("k", [576, 1088, 1536, 4096])  # sums in blocks of 512 / 1,024 inputs
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_give_onednns_floats_whatever_the_row_count(k, with_bias, gemv_on):
    """The prefix cache's promise at the matmul: a token's row computed in a step of few rows
    (this path) equals the same row computed among many (oneDNN's prefill), bit for bit."""
    gen = torch.Generator().manual_seed(k)
    weight = torch.randn(192, k, generator=gen)
    bias = torch.randn(192, generator=gen) if with_bias else None
    packed = pack_weight(weight, bias)
    assert packed is not None and packed.address and packed.k_block in (k, *cpu_gemv.K_BLOCKS)
    x = torch.randn(100, k, generator=gen)
    many = torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")
    for rows in (1, 2, 5, 32):
        few = packed_linear(x[:rows], packed, bias)
        assert torch.equal(few, many[:rows]), (rows, (few - many[:rows]).abs().max())


@needs_gemv
@pytest.mark.parametrize("k", [64, 576, 1536])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_rows_give_onednns_values(k, with_bias, gemv_on):
    """bfloat16 weights (oneDNN's pair layout, vdpbf16ps): every row count of the C path gives
    oneDNN's many-row outputs bit for bit, and both are near the float32 product."""
    if not cpu_gemv.BUILT_BF16:
        pytest.skip("no AVX512_BF16 on this CPU")
    gen = torch.Generator().manual_seed(k + 1)
    weight = torch.randn(200, k, generator=gen).bfloat16()
    bias = torch.randn(200, generator=gen).bfloat16() if with_bias else None
    packed = pack_weight(weight, bias)
    assert packed is not None and packed.address and packed.k_block % 2 == 0
    x = torch.randn(64, k, generator=gen).bfloat16()
    many = torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")
    for rows in (1, 3, 5, 32):
        few = cpu_gemv.gemv(x[:rows], packed.address, 200, k, packed.k_block, torch.bfloat16, bias)
        assert few is not None and few.dtype == torch.bfloat16
        assert torch.equal(few, many[:rows]), (rows, (few.float() - many[:rows].float()).abs())
        assert torch.equal(packed_linear(x[:rows], packed, bias), few)
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(many.float(), want, atol=0.1, rtol=2e-2)
    assert cpu_gemv.gemv(x[:1].float(), packed.address, 200, k, packed.k_block, torch.bfloat16,
                         None) is None  # a float32 row is never read against bfloat16 weights


@needs_gemv
def test_strided_rows_and_more_rows_than_the_c_path(gemv_on):
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 64, generator=gen)
    packed = pack_weight(weight)
    assert packed is not None and packed.address
    wide = torch.randn(3, 100, generator=gen)
    x = wide[:, 10:74]  # rows 100 floats apart
    got = cpu_gemv.gemv(x, packed.address, 200, 64, packed.k_block, torch.float32, None)
    assert got is not None
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-4, rtol=1e-5)
    many = torch.randn(cpu_gemv.MAX_ROWS + 1, 64, generator=gen)
    f32 = torch.float32
    assert cpu_gemv.gemv(many, packed.address, 200, 64, packed.k_block, f32, None) is None
    torch.testing.assert_close(packed_linear(many, packed, None), F.linear(many, weight),
                               atol=1e-4, rtol=1e-5)


@needs_gemv
def test_what_the_c_path_refuses(gemv_on):
    # K not a multiple of 16: oneDNN pads it, a layout the loop does not read (size check)
    padded = pack_weight(torch.randn(1000, 40))
    assert padded is not None and padded.address == 0
    odd = pack_weight(torch.randn(64, 63).bfloat16())  # bfloat16 pairs need an even K
    assert odd is None or odd.address == 0
    packed = pack_weight(torch.randn(64, 64))
    assert packed is not None and packed.address
    f32 = torch.float32
    assert cpu_gemv.gemv(torch.randn(2, 64).double(), packed.address, 64, 64, 64, f32, None) is None
    columns = torch.randn(2, 64).t().contiguous().t()
    assert cpu_gemv.gemv(columns, packed.address, 64, 64, 64, f32, None) is None
    assert cpu_gemv.gemv(torch.randn(1, 2, 64), packed.address, 64, 64, 64, f32, None) is None
    assert cpu_gemv.gemv(torch.randn(1, 64), 0, 64, 64, 64, f32, None) is None  # no address
    assert cpu_gemv.gemv(torch.randn(1, 80), packed.address, 64, 64, 64, f32, None) is None  # wide
    bf16_x = torch.randn(1, 64).bfloat16()  # a float32 weight: never read as bfloat16
    assert cpu_gemv.gemv(bf16_x, packed.address, 64, 64, 64, f32, None) is None
    with pytest.raises(RuntimeError):  # oneDNN reports the wrong width
        packed_linear(torch.randn(1, 80), packed, None)
    wide_bias = torch.ones(64).double()
    assert cpu_gemv.gemv(torch.randn(1, 64), packed.address, 64, 64, 64, f32, wide_bias) is None


@needs_gemv
def test_a_mismatching_product_keeps_onednn(monkeypatch, gemv_on):
    """The probe check: a C product that is not oneDNN's, bit for bit, leaves the address 0."""
    real = cpu_gemv.gemv

    def off_by_one(*args, **kwargs):
        out = real(*args, **kwargs)
        return None if out is None else out + 1e-3

    monkeypatch.setattr(cpu_gemv, "gemv", off_by_one)
    packed = pack_weight(torch.randn(128, 64))
    assert packed is not None and packed.address == 0


def test_switched_off_nothing_is_read(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "ENABLED", False)
    packed = pack_weight(torch.randn(64, 64))
    assert packed is None or packed.address == 0
    assert cpu_gemv.gemv(torch.randn(1, 64), 12345, 64, 64, 64, torch.float32, None) is None


@needs_gemv
@pytest.mark.parametrize("batch", [1, 3])
def test_the_demo_model_decodes_the_same_tokens_with_the_c_path(
    batch, monkeypatch, gemv_on
):
    """Greedy decode steps of the demo model (float32, packed weights) with the C path on and
    off: logits within 1e-4 and the same token at every step, batch 1 and 3."""
    from prefixkv.models.demo import ensure_demo_model
    from prefixkv.runner.model_runner import ModelRunner, RunItem

    monkeypatch.setattr(cpu_gemv, "ENABLED", True)  # the addresses are taken at packing
    runner = ModelRunner(ensure_demo_model(), dtype="float32", num_kv_blocks=64)
    layer = runner.model.model.layers[0]
    assert layer.mlp.down_proj.packed is not None and layer.mlp.down_proj.packed.address
    prompts = [[(29 * i + 7 * b) % 250 + 3 for i in range(40)] for b in range(batch)]
    tables = [list(range(1 + 10 * b, 11 + 10 * b)) for b in range(batch)]

    def run(enabled: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cpu_gemv, "ENABLED", enabled)
        items = [RunItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
        logits = [runner.execute(items)]
        for pos in range(40, 50):
            toks = logits[-1].argmax(-1).tolist()
            logits.append(runner.execute(
                [RunItem([tok], pos, t) for tok, t in zip(toks, tables, strict=True)]))
        return logits

    on, off = run(True), run(False)
    for a, b in zip(on, off, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()


def test_the_environment_switch_turns_the_c_path_off():
    code = "from prefixkv.models import cpu_gemv as c; print(c.ENABLED, c.BUILT)"
    env = {**os.environ, "PREFIXKV_CPU_GEMV": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["False", str(cpu_gemv.BUILT)], out.stderr
