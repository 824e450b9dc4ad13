"""The C prefill-attention kernel (prefixkv/runner/_cpu_attn.c) against dense SDPA attention,
alone and inside PagedAttention, and its switches."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from prefixkv.runner import KVPool, PagedAttention, cpu_attention

from test_paged_attention import dense

needs_kernel = pytest.mark.skipif(not cpu_attention.BUILT, reason="C kernel not built / no AVX-512")


def test_the_kernel_is_built_where_it_can_run(c_compiler, avx512_cpu):
    """`pip install -e .` builds prefixkv.runner._cpu_attn where a compiler is present: on an
    x86-64 AVX-512 CPU an optional build that silently failed would cost 1.5x on prefill."""
    assert cpu_attention.BUILT, "the C kernel was not built: run `pip install -e .`"


def _pool(
    num_blocks: int, bs: int, kv_heads: int, d: int, gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> KVPool:
    pool = KVPool(
        num_layers=1, num_blocks=num_blocks, block_size=bs, num_kv_heads=kv_heads, head_dim=d,
        dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    return pool


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "bs", "start", "n"),
    [
        (4, 2, 64, 16, 0, 1),  # one query, nothing cached
        (4, 2, 64, 16, 0, 7),  # fewer rows than a micro-tile
        (4, 2, 64, 1, 5, 33),  # block size 1
        (9, 3, 64, 16, 130, 70),  # SmolLM2's heads, a cached prefix ending inside a block
        (8, 8, 128, 16, 20, 50),  # no GQA, 128-wide heads (P x V in two column chunks)
        (4, 1, 32, 3, 100, 5),  # MQA, odd block size, 32-wide heads
        (6, 2, 80, 16, 40, 40),  # 80-wide heads (a 16-column chunk)
        (2, 1, 256, 8, 64, 64),  # the widest head the kernel takes; tiles end at the context
        (4, 2, 64, 16, 1000, 130),  # many key tiles, several position blocks
        (4, 2, 64, 16, 1000, 20),  # a short chunk on a long prefix: keys split, parts merged
        (4, 1, 64, 16, 200, 100),  # split keys and several position blocks
        (9, 3, 64, 1, 2000, 30),  # SmolLM2's warm request at block size 1
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dense_attention(heads, kv_heads, d, bs, start, n, threads, dtype):
    """Causal attention of ``n`` queries at positions ``start..`` over a scrambled block table,
    queries a strided view (as the model's fused q/k/v gives), output written in place; bf16
    against float32 attention over the same bf16 values (only the output's rounding apart)."""
    gen = torch.Generator().manual_seed(n + start)
    nb = -(-(start + n) // bs)
    pool = _pool(2 * nb + 3, bs, kv_heads, d, gen, dtype)
    table = torch.randperm(2 * nb + 3, generator=gen)[:nb]
    k_cache, v_cache = pool.layer(0)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, : heads * d].view(n, heads, d)
    out = torch.full((n, heads, d), float("nan"), dtype=dtype)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_attention.prefill(out, q, k_cache, v_cache, table, start)
    finally:
        torch.set_num_threads(saved)
    k = k_cache[table].flatten(0, 1)[: start + n].float()
    v = v_cache[table].flatten(0, 1)[: start + n].float()
    expected = dense(q.float(), k, v)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    else:  # the float32 result rounded to bf16: within half a bf16 step (2**-9 relative)
        torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=2**-8)


@needs_kernel
def test_large_scores_do_not_overflow():
    """Scores far beyond exp's range (about +-1e3): the online softmax keeps its running
    maximum, so the result stays finite, and as close to a float64 reference as SDPA's is
    (scores that large carry float32 rounding of ~1e-3 that exp amplifies in both)."""
    gen = torch.Generator().manual_seed(1)
    pool = _pool(8, 16, 1, 64, gen)
    pool.kv.mul_(30.0)
    k_cache, v_cache = pool.layer(0)
    table = torch.arange(8)
    q = torch.randn(100, 2, 64, generator=gen) * 30.0
    out = torch.empty_like(q)
    cpu_attention.prefill(out, q, k_cache, v_cache, table, 20)
    k, v = k_cache.flatten(0, 1)[:120], v_cache.flatten(0, 1)[:120]
    assert torch.isfinite(out).all()
    exact = dense(q.double(), k.double(), v.double())
    sdpa_err = (dense(q, k, v).double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= 1.5 * sdpa_err + 1e-6


@needs_kernel
def test_bad_arguments_raise_before_the_kernel_reads_memory():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = _pool(4, 16, 2, 64, gen).layer(0)
    q = torch.randn(10, 4, 64)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="2 blocks cover 32 positions, need 40"):
        cpu_attention.prefill(out, q, k_cache, v_cache, torch.arange(2), 30)
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 4\)"):
        cpu_attention.prefill(out, q, k_cache, v_cache, [4], 0)
    with pytest.raises(ValueError, match="queries 0"):
        cpu_attention.batch([(0, 0, 5, [0])], 16, 4)
    with pytest.raises(ValueError, match="covers 12 rows"):
        b = cpu_attention.batch([(2, 10, 0, [0])], 16, 4)
        cpu_attention.attend(out, q, k_cache, v_cache, b)
    with pytest.raises(ValueError, match="out must be"):
        cpu_attention.prefill(torch.empty(10, 4, 32), q, k_cache, v_cache, torch.arange(4), 0)
    with pytest.raises(ValueError, match="float32 or bfloat16 alike"):
        cpu_attention.prefill(out, q.bfloat16(), k_cache, v_cache, torch.arange(4), 0)
    with pytest.raises(ValueError, match="does not fit the pool"):
        cpu_attention.prefill(
            torch.empty(10, 3, 64), torch.randn(10, 3, 64), k_cache, v_cache, torch.arange(4), 0
        )


@needs_kernel
@pytest.mark.parametrize("mode", ["all", "prefills", "off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_runs_the_step_in_the_kernel(mode, dtype, monkeypatch):
    """One step with a decode, a fresh prefill and chunks on cached prefixes: every sequence
    in one kernel call, the prefills only (decodes on the torch path), or none; the same
    results (against dense attention over the pool's values) every way."""
    monkeypatch.setattr(cpu_attention, "ENABLED", mode != "off")
    monkeypatch.setattr(cpu_attention, "DECODES", mode == "all")
    heads, kv_heads, d, bs = 4, 2, 64, 16
    gen = torch.Generator().manual_seed(3)
    pool = _pool(64, bs, kv_heads, d, gen, dtype)
    pool.kv.zero_()
    starts, lens = [40, 0, 17, 100], [1, 37, 6, 20]
    ids = torch.randperm(64, generator=gen).tolist()
    tables, full_k, full_v = [], [], []
    for s, n in zip(starts, lens, strict=True):
        nb = -(-(s + n) // bs)
        tables.append(ids[:nb])
        ids = ids[nb:]
        full_k.append(torch.randn(s + n, kv_heads, d, generator=gen).to(dtype))
        full_v.append(torch.randn(s + n, kv_heads, d, generator=gen).to(dtype))
        if s:
            PagedAttention(pool, start_positions=[0], query_lens=[s], block_tables=[tables[-1]])(
                0, torch.zeros(s, heads, d, dtype=dtype), full_k[-1][:s], full_v[-1][:s]
            )
    attn = PagedAttention(pool, start_positions=starts, query_lens=lens, block_tables=tables)
    in_kernel = [] if attn._kernel is None else sorted(attn._kernel.info[1::4])
    assert in_kernel == sorted({"all": lens, "prefills": lens[1:], "off": []}[mode])
    assert len(attn._decodes) == (mode != "all")
    qs = [torch.randn(n, heads, d, generator=gen).to(dtype) for n in lens]
    out = attn(
        0,
        torch.cat(qs),
        torch.cat([k[s:] for k, s in zip(full_k, starts, strict=True)]),
        torch.cat([v[s:] for v, s in zip(full_v, starts, strict=True)]),
    )
    rows, tol = 0, {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    for q, k, v in zip(qs, full_k, full_v, strict=True):
        expected = dense(q.float(), k.float(), v.float())
        torch.testing.assert_close(out[rows : rows + len(q)].float(), expected, atol=tol, rtol=0)
        rows += len(q)


def test_other_dtypes_and_narrow_heads_keep_sdpa():
    gen = torch.Generator().manual_seed(0)
    assert not cpu_attention.usable(torch.zeros(2, 1, 4, 16, 2, 64, dtype=torch.float16), 64)
    assert not cpu_attention.usable(torch.zeros(2, 1, 4, 16, 2, 8), 8)
    assert not cpu_attention.usable(torch.zeros(2, 1, 4, 16, 2, 512), 512)
    for dtype in (torch.float32, torch.bfloat16):
        pool = _pool(4, 16, 2, 64, gen, dtype)
        assert cpu_attention.usable(pool.kv, 64) == cpu_attention.ENABLED


def test_the_environment_switch_turns_the_kernel_off():
    code = "from prefixkv.runner import cpu_attention as c; print(c.ENABLED, c.BUILT)"
    env = {**os.environ, "PREFIXKV_CPU_ATTENTION": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["False", str(cpu_attention.BUILT)], out.stderr


@needs_kernel
def test_the_demo_model_gives_the_same_logits_and_tokens_with_the_kernel(monkeypatch):
    """A cold 300-token prefill, a warm 40-token chunk on it and greedy decode steps of the demo
    model, kernel on and off: logits within 1e-4, the same greedy token at every step."""
    from prefixkv.models.demo import ensure_demo_model
    from prefixkv.runner.model_runner import ModelRunner, RunItem

    runner = ModelRunner(ensure_demo_model(), dtype="float32", num_kv_blocks=64)
    prompt = [(37 * i) % 250 + 3 for i in range(340)]
    table = list(range(1, 40))

    def run(enabled: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cpu_attention, "ENABLED", enabled)
        logits = [runner.execute([RunItem(prompt[:300], 0, table)])]
        logits.append(runner.execute([RunItem(prompt[300:], 300, table)]))
        for pos in range(340, 350):
            tok = int(logits[-1].argmax())
            logits.append(runner.execute([RunItem([tok], pos, table)]))
        return logits

    on, off = run(True), run(False)
    for a, b in zip(on, off, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        assert int(a.argmax()) == int(b.argmax())
