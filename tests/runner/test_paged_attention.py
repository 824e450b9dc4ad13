"""PagedAttention vs dense causal attention over the same keys, through scrambled block tables."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv.runner import KVPool, PagedAttention, attention

HQ, HKV, D, BS = 4, 2, 8, 4


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions over all of ``k``/``v`` ([L, H, D])."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize(
    ("starts", "lens"),
    [
        ([0, 5, 30, 31, 2, 80], [1, 1, 1, 1, 1, 1]),  # decodes of mixed lengths (grouped)
        ([9, 0, 17, 40], [1, 13, 6, 1]),  # decodes + fresh prefill + chunk on a cached prefix
        ([16, 17, 3, 0], [2, 9, 5, 7]),  # chunks on prefixes ending at / inside a block
    ],
)
@pytest.mark.parametrize("scrambled", [True, False])  # False: each context is one block run (views)
@pytest.mark.parametrize("split", [False, True])  # True: every chunk on a prefix takes the CPU split
def test_matches_dense_attention(starts, lens, scrambled, split, monkeypatch):
    if split:
        monkeypatch.setattr(attention, "_MASK_ELEMENTS", 0)
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(
        num_layers=2,
        num_blocks=64,
        block_size=BS,
        num_kv_heads=HKV,
        head_dim=D,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    ids = torch.randperm(64, generator=gen).tolist() if scrambled else list(range(64))
    tables, full_k, full_v = [], [], []
    for i, (s, n) in enumerate(zip(starts, lens, strict=True)):
        nb = -(-(s + n) // BS)
        tables.append(ids[:nb])
        ids = ids[nb:]
        full_k.append(torch.randn(s + n, HKV, D, generator=gen))
        full_v.append(torch.randn(s + n, HKV, D, generator=gen))
        # the cached prefix, written as an earlier step would have
        if s:
            PagedAttention(pool, start_positions=[0], query_lens=[s], block_tables=[tables[i]])(
                1, torch.zeros(s, HQ, D), full_k[i][:s], full_v[i][:s]
            )
    qs = [torch.randn(n, HQ, D, generator=gen) for n in lens]
    attn = PagedAttention(pool, start_positions=starts, query_lens=lens, block_tables=tables)
    out = attn(
        1,
        torch.cat(qs),
        torch.cat([k[s:] for k, s in zip(full_k, starts, strict=True)]),
        torch.cat([v[s:] for v, s in zip(full_v, starts, strict=True)]),
    )
    assert attn.num_tokens == sum(lens)
    rows = 0
    for q, k, v in zip(qs, full_k, full_v, strict=True):
        torch.testing.assert_close(out[rows : rows + len(q)], dense(q, k, v), atol=1e-5, rtol=0)
        rows += len(q)
    assert not pool.kv[:, 0].any()  # layer 0 untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # SDPA / float32 matmuls
def test_batched_decodes_of_mixed_lengths_in_each_kv_dtype(dtype):
    """Four decodes of different lengths in one padded group, fp32 KV (one SDPA call) and bf16
    KV (float32 matmuls), against dense attention over the same (rounded) keys."""
    gen = torch.Generator().manual_seed(2)
    pool = KVPool(num_layers=1, num_blocks=64, block_size=BS, num_kv_heads=HKV, head_dim=D,
                  dtype=dtype, device=torch.device("cpu"))
    starts, tables, ks, vs = [40, 37, 44, 41], [], [], []
    for i, s in enumerate(starts):
        tables.append(list(range(16 * i, 16 * i + 12)))
        k = torch.randn(s + 1, HKV, D, generator=gen).to(dtype)
        v = torch.randn(s + 1, HKV, D, generator=gen).to(dtype)
        PagedAttention(pool, start_positions=[0], query_lens=[s], block_tables=[tables[i]])(
            0, torch.zeros(s, HQ, D, dtype=dtype), k[:s], v[:s])
        ks.append(k)
        vs.append(v)
    qs = torch.randn(4, HQ, D, generator=gen).to(dtype)
    attn = PagedAttention(pool, start_positions=starts, query_lens=[1] * 4, block_tables=tables)
    assert len(attn._decodes) == 1 and attn._decodes[0].keep is not None  # one padded group
    out = attn(0, qs, torch.cat([k[-1:] for k in ks]), torch.cat([v[-1:] for v in vs]))
    assert out.dtype == dtype
    for i in range(4):
        want = dense(qs[i : i + 1].float(), ks[i].float(), vs[i].float())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i : i + 1].float(), want, atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("run", [True, False])  # the shared blocks consecutive (read in place)
def test_decodes_sharing_a_cached_prefix_read_it_once(dtype, run, monkeypatch):
    """Four decodes whose tables start with the same 66 blocks (264 tokens: a shared system
    prompt) and go on in blocks of their own: the shared prefix is read once for the four
    queries, merged with each one's own keys; equal to dense attention over each context.
    (264 shared tokens and 3 x 264 copies saved are below the shipped thresholds: lowered here
    to take the path on a small pool; ``test_shared_prefix_threshold`` checks the shipped rule.)"""
    monkeypatch.setattr(attention, "_SHARED_MIN_COPIES", 500)
    monkeypatch.setattr(attention, "_SHARED_MIN_TOKENS", 256)
    gen = torch.Generator().manual_seed(3)
    pool = KVPool(num_layers=1, num_blocks=128, block_size=BS, num_kv_heads=HKV, head_dim=D,
                  dtype=dtype, device=torch.device("cpu"))
    prefix = list(range(10, 76))
    if not run:
        prefix = [prefix[i] for i in torch.randperm(66, generator=gen).tolist()]
    shared_k = torch.randn(264, HKV, D, generator=gen).to(dtype)
    shared_v = torch.randn(264, HKV, D, generator=gen).to(dtype)
    PagedAttention(pool, start_positions=[0], query_lens=[264], block_tables=[prefix])(
        0, torch.zeros(264, HQ, D, dtype=dtype), shared_k, shared_v)
    own_lens, tables, ks, vs = [6, 10, 3, 1], [], [], []
    for i, n in enumerate(own_lens):  # n tokens of its own, the last one new this step
        tables.append(prefix + list(range(80 + 4 * i, 84 + 4 * i)))
        k = torch.cat([shared_k, torch.randn(n, HKV, D, generator=gen).to(dtype)])
        v = torch.cat([shared_v, torch.randn(n, HKV, D, generator=gen).to(dtype)])
        if n > 1:
            PagedAttention(pool, start_positions=[264], query_lens=[n - 1],
                           block_tables=[tables[i]])(
                0, torch.zeros(n - 1, HQ, D, dtype=dtype), k[264:-1], v[264:-1])
        ks.append(k)
        vs.append(v)
    starts = [264 + n - 1 for n in own_lens]
    qs = torch.randn(4, HQ, D, generator=gen).to(dtype)
    attn = PagedAttention(pool, start_positions=starts, query_lens=[1] * 4, block_tables=tables)
    assert len(attn._decodes) == 1 and attn._decodes[0].shared is not None
    assert attn._decodes[0].shared.tolist() == prefix
    assert attn._decodes[0].shared_first == (10 if run else None)
    out = attn(0, qs, torch.cat([k[-1:] for k in ks]), torch.cat([v[-1:] for v in vs]))
    assert out.dtype == dtype and out.shape == (4, HQ, D)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(4):
        want = dense(qs[i : i + 1].float(), ks[i].float(), vs[i].float())
        torch.testing.assert_close(out[i : i + 1].float(), want, atol=tol, rtol=0)
    three = PagedAttention(pool, start_positions=starts[:3], query_lens=[1] * 3,
                           block_tables=tables[:3])
    assert three._decodes[0].shared is not None
    out3 = three(0, qs[:3], torch.cat([k[-1:] for k in ks[:3]]), torch.cat([v[-1:] for v in vs[:3]]))
    torch.testing.assert_close(out3, out[:3], atol=tol, rtol=0)
    two = PagedAttention(pool, start_positions=starts[:2], query_lens=[1] * 2,
                         block_tables=tables[:2])
    assert two._decodes[0].shared is None  # fewer than three: each gathers its context


@pytest.mark.parametrize(
    ("seqs", "shared_tokens", "taken"),
    [
        (3, 1200, True),  # (3 - 1) x 1,200 = 2,400 copies saved: at the threshold, 1.03-1.04x
        (8, 600, True),  # 4,200 copies: 1.07-1.08x
        (3, 1000, False),  # 2,000 copies: 0.98-1.10x, each sequence gathers its own
        (6, 400, False),  # 2,000 copies: 0.94-0.97x
        (5, 500, False),  # 2,000 copies (whole blocks of 4 here): 0.97-1.02x
        (3, 500, False),  # 1,000 copies: 0.96x
        (4, 500, False),  # 1,500 copies: 0.97x
        (2, 4000, False),  # two sequences never take it (0.84-1.04x)
        (8, 300, False),  # 2,100 copies but a short prefix: 0.92-0.97x
        (20, 128, False),  # below 384 shared tokens
    ],
)
def test_shared_prefix_threshold(seqs, shared_tokens, taken):
    """The shipped rule: a decode group reads its shared prefix once when it has three or more
    sequences, 384+ shared tokens and ``(B - 1) x shared tokens >= 2,400`` copies saved."""
    nb = shared_tokens // BS
    pool = KVPool(num_layers=1, num_blocks=nb + 4 * seqs + 1, block_size=BS, num_kv_heads=HKV,
                  head_dim=D, dtype=torch.float32, device=torch.device("cpu"))
    tables = [list(range(nb)) + [nb + 4 * i, nb + 4 * i + 1] for i in range(seqs)]
    attn = PagedAttention(pool, start_positions=[shared_tokens + 5] * seqs,
                          query_lens=[1] * seqs, block_tables=tables)
    assert len(attn._decodes) == 1
    assert (attn._decodes[0].shared is not None) is taken

