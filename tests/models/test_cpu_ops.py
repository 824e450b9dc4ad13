"""The fused C elementwise steps (prefixkv/models/_cpu_ops.c) against torch's expressions, their
fall-backs, and the model with them on and off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from prefixkv.models import cpu_ops
from prefixkv.models.llama import apply_rope

needs_ops = pytest.mark.skipif(not cpu_ops.BUILT, reason="C ops not built / no AVX-512")


@pytest.fixture
def ops_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C path on, whatever PREFIXKV_CPU_OPS says for the test process."""
    monkeypatch.setattr(cpu_ops, "ENABLED", True)


def test_the_ops_are_built_where_they_can_run(c_compiler, avx512_cpu):
    assert cpu_ops.BUILT, "the C ops were not built: run `pip install -e .`"


@needs_ops
@pytest.mark.parametrize("rows", [1, 7, 3000])  # one thread / over the team
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(rows, with_residual, ops_on):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen) * 3
    w = torch.randn(96, generator=gen)
    res = torch.randn(rows, 96, generator=gen) if with_residual else None
    stream = x + res if res is not None else x.clone()
    expected = F.rms_norm(stream, (96,), w, 1e-6)
    got = cpu_ops.rms_norm(x, w, 1e-6, res)
    assert got is not None
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x, stream, atol=0, rtol=0)  # the residual went into x in place


@needs_ops
@pytest.mark.parametrize("rows", [1, 6, 600])  # one thread / over the team
def test_per_head_rms_norm_matches_torch_and_the_row_norm(rows, ops_on):
    """Qwen3's q/k norm on the q heads of a fused qkv output (a strided view): torch's values to
    float32 rounding, and each head bit for bit the row norm's (the module path and the C
    decode path call the same row function, so their hidden states stay equal)."""
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 6 * 64, generator=gen) * 2
    w = torch.randn(64, generator=gen)
    q = qkv[:, : 4 * 64].view(rows, 4, 64)  # four heads of 64, a row 384 floats apart
    got = cpu_ops.rms_norm_heads(q, w, 1e-6)
    assert got is not None and got.shape == (rows, 4, 64)
    torch.testing.assert_close(got, F.rms_norm(q, (64,), w, 1e-6), atol=1e-5, rtol=1e-5)
    by_rows = cpu_ops.rms_norm(q.reshape(rows * 4, 64), w, 1e-6)
    assert by_rows is not None and torch.equal(got.reshape(rows * 4, 64), by_rows)
    assert cpu_ops.rms_norm_heads(qkv.view(rows, 12, 32)[:, ::2], w[:32], 1e-6) is None  # gaps


@pytest.mark.skipif(cpu_ops._ops is None, reason="C ops not built")
def test_scatter_rows_writes_a_steps_kv_like_index_copy():
    """A step's new K rows (a strided view of the fused qkv output) into the pool's rows at the
    step's slots, as index_copy_ writes them; a slot outside the pool is an IndexError and
    nothing is written."""
    pool = torch.zeros(40, 2, 64)
    qkv = torch.randn(3, 8 * 64)
    k_new = qkv[:, 4 * 64 : 6 * 64].view(3, 2, 64)
    slots = torch.tensor([17, 3, 39])
    want = pool.clone().index_copy_(0, slots, k_new)
    cpu_ops._ops.scatter_rows(k_new.data_ptr(), qkv.stride(0), pool.data_ptr(), slots.data_ptr(),
                              3, 128, 40)
    assert torch.equal(pool, want)
    before, bad = pool.clone(), torch.tensor([0, 40, 1])
    with pytest.raises(IndexError, match="slot 40"):
        cpu_ops._ops.scatter_rows(k_new.data_ptr(), qkv.stride(0), pool.data_ptr(),
                                  bad.data_ptr(), 3, 128, 40)
    assert torch.equal(pool, before)


@needs_ops
@pytest.mark.parametrize("rows", [1, 5, 2000])
def test_silu_mul_matches_torch(rows, ops_on):
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 48, generator=gen) * 6  # exp's clamps reached at the tails
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.split(48, dim=-1)
    got = cpu_ops.silu_mul(gate_up, 48)
    assert got is not None
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-6, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("rows", [1, 9, 1500])
def test_rope_in_place_matches_torch(rows, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 7 * 64, generator=gen)
    x = qkv[:, : 5 * 64].view(rows, 5, 64)  # q and k heads of a fused qkv row, strided
    freqs = torch.randn(rows, 32, generator=gen) * 10
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    expected = apply_rope(x.clone(), cos, sin)
    monkeypatch.setattr(cpu_ops, "ENABLED", True)
    v_before = qkv[:, 5 * 64 :].clone()
    got = apply_rope(x, cos, sin)
    assert got.data_ptr() == x.data_ptr()  # in place
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 5 * 64 :], v_before)  # nothing past the rotated heads touched


@needs_ops
@pytest.mark.parametrize("first, n", [(0, 1), (2048, 32), (0, 9000), (131_000, 40), (2**21, 5)])
def test_rope_cos_sin_is_correctly_rounded(first, n, ops_on):
    """Each value is cos / sin of the float32 angle torch forms (position x inverse frequency),
    rounded once from double precision: equal to float64 torch rounded to float32, within an
    ulp of torch's own float32 cos / sin; both halves of a row alike. The last case's angles
    (above 1.6e6 radians) take libm's reduction."""
    inv = 1.0 / (1e6 ** (torch.arange(0, 64, 2).float() / 64))  # rope_inv_freq's, theta 1e6
    positions = torch.arange(first, first + n * 7, 7)
    got = cpu_ops.rope_cos_sin(positions, inv)
    assert got is not None
    cos, sin = got
    assert cos.shape == sin.shape == (n, 1, 64)
    angle = positions[:, None].float() * inv[None, :]
    for have, exact, single in ((cos, angle.double().cos(), angle.cos()),
                                (sin, angle.double().sin(), angle.sin())):
        assert torch.equal(have[:, 0, :32], have[:, 0, 32:])
        assert torch.equal(have[:, 0, :32], exact.float())
        torch.testing.assert_close(have[:, 0, :32], single, atol=1.2e-7, rtol=0)


def test_rope_cos_sin_falls_back_where_it_does_not_fit(ops_on):
    inv = torch.ones(16)
    assert cpu_ops.rope_cos_sin(torch.arange(3, dtype=torch.int32), inv) is None
    assert cpu_ops.rope_cos_sin(torch.arange(3), torch.ones(20)) is None  # half not 16k
    assert cpu_ops.rope_cos_sin(torch.arange(3), inv.double()) is None


@pytest.mark.skipif(cpu_ops._ops is None, reason="C ops not built")
def test_gather_rows_is_an_embedding_lookup():
    table = torch.randn(50, 96)
    ids = torch.tensor([49, 0, 7, 7])
    out = torch.empty(4, 96)
    cpu_ops._ops.gather_rows(table.data_ptr(), 50, 96, ids.data_ptr(), 4, out.data_ptr())
    assert torch.equal(out, F.embedding(ids, table))
    before, bad = out.clone(), torch.tensor([1, 50])
    with pytest.raises(IndexError, match="id 50"):
        cpu_ops._ops.gather_rows(table.data_ptr(), 50, 96, bad.data_ptr(), 2, out.data_ptr())
    assert torch.equal(out, before)


def test_what_does_not_fit_falls_back_untouched(monkeypatch):
    x = torch.randn(4, 40)  # width not a multiple of 16
    assert cpu_ops.rms_norm(x, torch.ones(40), 1e-6) is None
    assert cpu_ops.silu_mul(torch.randn(4, 80), 40) is None
    assert cpu_ops.rms_norm(torch.randn(4, 64, dtype=torch.bfloat16), torch.ones(64), 1e-6) is None
    y = torch.randn(3, 2, 48)  # 48-wide heads: halves not a multiple of 16
    assert cpu_ops.rope_(y, torch.ones(3, 1, 48), torch.zeros(3, 1, 48)) is None
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    assert cpu_ops.rms_norm(torch.randn(4, 64), torch.ones(64), 1e-6) is None


@needs_ops
def test_the_demo_model_gives_the_same_tokens_with_the_ops(monkeypatch):
    """Greedy decoding of the demo model (prefill, warm chunk, decode steps) with the fused ops
    on and off: logits within 1e-4 and the same token at every step."""
    from prefixkv.models.demo import ensure_demo_model
    from prefixkv.runner.model_runner import ModelRunner, RunItem

    runner = ModelRunner(ensure_demo_model(), dtype="float32", num_kv_blocks=64)
    prompt = [(29 * i) % 250 + 3 for i in range(200)]

    def run(enabled: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cpu_ops, "ENABLED", enabled)
        logits = [runner.execute([RunItem(prompt[:170], 0, list(range(1, 30)))])]
        logits.append(runner.execute([RunItem(prompt[170:], 170, list(range(1, 30)))]))
        for pos in range(200, 210):
            tok = int(logits[-1].argmax())
            logits.append(runner.execute([RunItem([tok], pos, list(range(1, 30)))]))
        return logits

    on, off = run(True), run(False)
    for a, b in zip(on, off, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        assert int(a.argmax()) == int(b.argmax())


def test_the_environment_switch_turns_the_ops_off():
    code = "from prefixkv.models import cpu_ops as c; print(c.ENABLED, c.BUILT)"
    env = {**os.environ, "PREFIXKV_CPU_OPS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["False", str(cpu_ops.BUILT)], out.stderr
