"""Attention over the paged KV pool for one ``execute`` step.

A :class:`PagedAttention` is built per step from the sequences' positions and block tables and
handed to the model's forward as its ``attention`` callable (no global metadata). For every
layer it (1) writes the new tokens' K/V into their slots, then (2) computes attention:

* with a float32 or bf16 pool on an AVX-512 CPU, the whole step (every prefill chunk and
  decode) is one call of the C kernel per layer (``cpu_attention.py``), reading each
  sequence's keys in place through its block table. Otherwise, the torch paths below:
* prefill chunks (several new tokens): per sequence, the new queries attend causally to all
  keys at positions ``[0, start_pos + n)`` (cached prefix + the chunk itself), with torch
  SDPA: the context is read in place when its blocks are one contiguous run (a view of the
  pool, no copy), gathered through the block table otherwise. A short chunk gets one SDPA call
  with a mask built once per step (additive, in the KV dtype, on CPU); on CPU a long chunk on a
  cached prefix runs as two unmasked flash calls, the prefix and the chunk causally over its
  own K/V, merged by their log-sum-exp (no ``[n, ctx]`` mask);
* decodes (one new token): batched, keys of the decoding sequences gathered into a padded
  ``[B, L]`` view and masked by each sequence's length (one SDPA call for float32 KV, float32
  matmuls otherwise); sequences are grouped by context length so that padding stays small.
  On CPU, when three or more decodes of a group start with the same blocks (a cached system
  prompt, 384+ tokens) and reading them once saves enough copies (``(B - 1) x shared tokens
  >= 2,400``), those keys are read once for all of them and merged with each sequence's own
  keys by log-sum-exp, instead of being gathered once per sequence.

Plain torch, device agnostic (CPU and CUDA).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixkv.runner import cpu_attention
from prefixkv.runner.kv_pool import KVPool


@dataclass(slots=True)
class _Prefill:
    q_start: int  # first row of this sequence in the flat token batch
    q_len: int
    start_pos: int  # tokens already cached before this chunk
    first_block: int | None  # context [0, start_pos + q_len) is blocks first_block, +1, ...
    blocks: torch.Tensor | None  # else the block ids to gather (None when start_pos == 0)
    mask: torch.Tensor | None  # [q_len, ctx]; None: start_pos == 0, or the two-call split


@dataclass(slots=True)
class _DecodeBatch:
    rows: torch.Tensor | None  # [B] rows of the flat token batch; None: all rows, in order
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0
    max_len: int  # longest context in the batch
    keep: torch.Tensor | None  # [B, 1, 1, max_len] bool (key position < context length)
    shared: torch.Tensor | None = None  # CPU: blocks every table starts with, read once
    shared_first: int | None = None  # the first of them when they are one run (read in place)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Rows of ``blocks`` (any shape ``S``) from ``cache`` ``[N, bs, H, D]`` -> ``[*S, bs, H, D]``."""
    flat = cache.view(cache.shape[0], -1).index_select(0, blocks.reshape(-1))
    return flat.view(*blocks.shape, *cache.shape[1:])


class PagedAttention:
    """The ``attention`` callable for one step; see the module docstring.

    ``start_positions[i]``, ``query_lens[i]`` and ``block_tables[i]`` describe sequence ``i``,
    whose ``query_lens[i]`` tokens occupy consecutive rows of the flat batch in order. The
    caller guarantees each block table covers ``start_pos + query_len`` positions and holds
    valid block ids (the runner validates). The K/V of positions ``< start_pos`` must already
    be in the pool.
    """

    def __init__(
        self,
        pool: KVPool,
        *,
        start_positions: Sequence[int],
        query_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> None:
        self.pool = pool
        device = pool.kv.device
        bs = pool.block_size
        slots: list[int] = []
        self._prefills: list[_Prefill] = []
        kernel = cpu_attention.usable(pool.kv, pool.head_dim)
        in_kernel: list[tuple[int, int, int, list[int]]] = []
        decodes: list[tuple[int, list[int], int]] = []
        row = 0
        for start, n, table in zip(start_positions, query_lens, block_tables, strict=True):
            ctx = start + n
            needed = list(table[: (ctx + bs - 1) // bs])
            slots.extend(needed[p // bs] * bs + p % bs for p in range(start, ctx))
            if n == 1:
                decodes.append((row, needed, ctx))
            elif kernel:
                in_kernel.append((row, n, start, needed))
            else:
                self._prefills.append(_prefill(row, n, start, needed, bs, pool.kv))
            row += n
        self.num_tokens = row
        self.slots = array("q", slots)  # each new token's KV row (the C path reads it)
        self._slot_mapping: torch.Tensor | None = None
        groups = []
        for group in _group_by_length(decodes):
            # the kernel takes every decode, also a group sharing a long cached prefix (read
            # once per sequence there, from cache: 1.24-1.36x the torch path's single read
            # since its micro-tiles hold all of a query's heads, docs/benchmarks.md)
            if kernel and cpu_attention.DECODES:
                in_kernel.extend((r, 1, n - 1, blocks) for r, blocks, n in group)
            else:
                groups.append(group)
        self._decodes = [_decode_batch(group, device, row, bs) for group in groups]
        self._kernel = (
            cpu_attention.batch(in_kernel, bs, pool.num_blocks) if in_kernel else None
        )  # the C kernel's sequences: usually the whole step

    @property
    def slot_mapping(self) -> torch.Tensor:
        """:attr:`slots` as an int64 tensor on the pool's device (made on first use: the C
        decode path never asks)."""
        if self._slot_mapping is None:
            flat = (torch.frombuffer(self.slots, dtype=torch.int64) if self.slots  # shares it
                    else torch.empty(0, dtype=torch.int64))
            self._slot_mapping = flat.to(self.pool.kv.device)
        return self._slot_mapping

    def kernel_batch(self) -> cpu_attention.Batch | None:
        """The C kernel's batch when it computes every sequence of the step (nothing on the
        torch paths), else ``None``: what the per-step decode path (``cpu_decode.py``) needs."""
        if self._prefills or self._decodes:
            return None
        return self._kernel

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store ``k``/``v`` ([T, Hkv, D]) of the new tokens; return attention output [T, Hq, D]."""
        k_cache, v_cache = self.pool.layer(layer_idx)
        heads_kv, dim = k.shape[1], k.shape[2]
        k_cache.view(-1, heads_kv, dim).index_copy_(0, self.slot_mapping, k)
        v_cache.view(-1, heads_kv, dim).index_copy_(0, self.slot_mapping, v)
        if (not self._prefills and self._kernel is None and len(self._decodes) == 1
                and self._decodes[0].rows is None):
            return _decode_attention(self._decodes[0], q, k_cache, v_cache)  # all rows, in order
        out = torch.empty_like(q)
        if self._kernel is not None:
            cpu_attention.attend(out, q, k_cache, v_cache, self._kernel)
        for p in self._prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            # SDPA gets 4-D [1, heads, len, D] views: 3-D inputs miss the fused CPU kernel.
            qs = q[rows].transpose(0, 1)[None]
            ks, vs = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            if p.start_pos == 0:  # nothing cached: the chunk's own K/V are the whole context
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            elif p.mask is not None:
                kc, vc = _context(p, k_cache), _context(p, v_cache)
                o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=p.mask, enable_gqa=True)
            else:  # CPU, long chunk: prefix and chunk apart, merged (module docstring)
                start = p.start_pos
                kp, vp = _context(p, k_cache)[:, :, :start], _context(p, v_cache)[:, :, :start]
                o = _merged(_FLASH_CPU(qs, kp, vp, 0.0, False), _FLASH_CPU(qs, ks, vs, 0.0, True))
            out[rows] = o[0].transpose(0, 1)
        for d in self._decodes:
            out[d.rows] = _decode_attention(d, q, k_cache, v_cache)
        return out


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""SDPA's CPU flash kernel, called directly for its log-sum-exp (``-> (out, lse)``)."""


_MASK_ELEMENTS = 1 << 18
"""Chunks with ``q_len * ctx`` up to this get one masked SDPA call; longer ones (CPU) the split."""


def _prefill(
    row: int, n: int, start: int, needed: list[int], bs: int, kv: torch.Tensor
) -> _Prefill:
    """A prefill chunk's plan (see the module docstring); ``needed`` covers its context."""
    if start == 0:
        return _Prefill(row, n, 0, None, None, None)
    ctx, device = start + n, kv.device
    run = needed == list(range(needed[0], needed[0] + len(needed)))
    blocks = None if run else torch.tensor(needed, device=device)
    mask = None
    if device.type == "cpu" and n * ctx <= _MASK_ELEMENTS:
        # additive, in the query dtype (what the flash kernel takes): -inf where key > query
        mask = torch.full((n, ctx), float("-inf"), dtype=kv.dtype).triu_(start + 1)
    elif device.type != "cpu":
        keys = torch.arange(ctx, device=device)
        mask = keys[None, :] <= torch.arange(start, ctx, device=device)[:, None]
    return _Prefill(row, n, start, needed[0] if run else None, blocks, mask)


def _context(p: _Prefill, cache: torch.Tensor) -> torch.Tensor:
    """Keys (or values) of positions ``[0, start_pos + q_len)`` as ``[1, Hkv, ctx, D]``."""
    ctx = p.start_pos + p.q_len
    if p.first_block is not None:  # one contiguous run of blocks: a view of the pool
        part = cache[p.first_block : p.first_block - (-ctx // cache.shape[1])]
    else:
        assert p.blocks is not None
        part = _gather(cache, p.blocks)
    return part.flatten(0, 1)[:ctx].transpose(0, 1)[None]


def _merged(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Attention over two disjoint key sets from each one's ``(out, lse)``: the softmax over
    their union, each part weighted by its share of the total exp-sum (in float32)."""
    (oa, la), (ob, lb) = a, b
    top = torch.maximum(la, lb)
    wa, wb = (la - top).exp_(), (lb - top).exp_()
    total = wa + wb
    out = oa.float() * (wa / total)[..., None]
    return out.add_(ob.float() * (wb / total)[..., None]).to(oa.dtype)


_MAX_PADDING = 1.25
"""A decode group's padded size (B x longest context) stays within this factor of its real size."""


def _group_by_length(
    decodes: list[tuple[int, list[int], int]],
) -> list[list[tuple[int, list[int], int]]]:
    """Split ``(row, blocks, context_len)`` decodes into groups of similar length.

    Batched decode pads every sequence to the longest context in its batch; grouping bounds
    that waste (one 2k-token sequence does not make seven 100-token ones read 2k keys each).
    """
    groups: list[list[tuple[int, list[int], int]]] = []
    total = 0
    for item in sorted(decodes, key=lambda d: -d[2]):
        if groups and groups[-1][0][2] * (len(groups[-1]) + 1) <= _MAX_PADDING * (total + item[2]):
            groups[-1].append(item)
            total += item[2]
        else:
            groups.append([item])
            total = item[2]
    return groups


_SHARED_MIN_SEQS = 3
_SHARED_MIN_TOKENS = 384
_SHARED_MIN_COPIES = 2400
"""A CPU decode group of ``B >= _SHARED_MIN_SEQS`` sequences whose block tables all start with
the same ``P >= _SHARED_MIN_TOKENS`` tokens' worth of blocks reads that shared prefix once for
all its queries (:func:`_decode_shared`) when the copies it saves, ``(B - 1) x P`` tokens, reach
``_SHARED_MIN_COPIES``. SmolLM2 decode steps against every sequence gathering its own copy
(``scripts/shared_decode_ab.py@a0a423d``, docs/benchmarks.md; six processes on one machine and three
runs on another): 3 sequences on 2,000 / 4,000 shared tokens 1.15-1.69x / 2.33x, 3 on 1,488 /
1,200 1.08-1.20x / 1.03-1.04x, 8 on 592 1.07-1.08x, 6 on 1,000 1.15-1.17x; near 2,000 copies
mostly a loss (6 on 400 0.94-0.97x, 4 on 688 0.95-1.01x, 5 on 496 0.97-1.02x; 3 on 992
0.98-1.10x), hence 2,400; below, 3 on 800-900 0.96-0.99x and 3 on 300-500 0.92-0.97x; short
prefixes lose even past 2,000 copies (8 on 288 0.92-0.97x, 9 on 256 0.95-0.96x); 2 sequences
0.84-1.04x even on 2,000, so two stay on the plain path. (The shared tokens are whole blocks:
3 prompts sharing 1,000 tokens share 992 at block size 16.)"""


def _worth_sharing(seqs: int, tokens: int) -> bool:
    """The thresholds above, for ``seqs`` sequences sharing ``tokens`` (block-aligned) tokens."""
    return (seqs >= _SHARED_MIN_SEQS and tokens >= _SHARED_MIN_TOKENS
            and (seqs - 1) * tokens >= _SHARED_MIN_COPIES)


def _shared_blocks(group: list[tuple[int, list[int], int]], block_size: int) -> int:
    """How many leading blocks every table of ``group`` shares (0 below the thresholds); each
    sequence keeps at least one key of its own after them."""
    limit = min((n - 1) // block_size for _, _, n in group)
    if not _worth_sharing(len(group), limit * block_size):
        return 0  # not even sharing every block could pass: no need to compare the tables
    tables = [blocks for _, blocks, _ in group]
    c = 0
    while c < limit and all(t[c] == tables[0][c] for t in tables):
        c += 1
    return c if _worth_sharing(len(group), c * block_size) else 0


def _decode_batch(
    group: list[tuple[int, list[int], int]], device: torch.device, num_rows: int,
    block_size: int = 0,
) -> _DecodeBatch:
    group = sorted(group)  # by row: a group holding every row then needs no scatter
    c = _shared_blocks(group, block_size) if device.type == "cpu" and block_size else 0
    head = group[0][1][:c]
    shared = torch.tensor(head, device=device) if c else None
    first = head[0] if c and head == list(range(head[0], head[0] + c)) else None
    if c:  # the rest of each sequence: its own blocks and keys after the shared prefix
        group = [(row, blocks[c:], n - c * block_size) for row, blocks, n in group]
    width = max(len(blocks) for _, blocks, _ in group)
    max_len = max(n for _, _, n in group)
    keep = None
    if any(n != max_len for _, _, n in group):
        lens = torch.tensor([n for _, _, n in group], device=device)
        keep = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[:, None, None]
    rows = [row for row, _, _ in group]
    return _DecodeBatch(
        rows=None if rows == list(range(num_rows)) else torch.tensor(rows, device=device),
        block_tables=torch.tensor(
            [blocks + [0] * (width - len(blocks)) for _, blocks, _ in group], device=device
        ),
        max_len=max_len,
        keep=keep,
        shared=shared,
        shared_first=first,
    )


def _decode_attention(
    d: _DecodeBatch, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> torch.Tensor:
    """Batched single-query attention over each sequence's padded, masked context.

    float32 KV: one SDPA call on ``[B, H, 1, D]`` queries and the gathered ``[B, Hkv, L, D]``
    K/V views (GQA in the kernel). Other dtypes: two batched matmuls and a softmax in float32
    (SDPA's CPU kernel in bf16 was 0.6x as fast here). Measured on SmolLM2, the fp32 SDPA call
    against the matmuls: decode steps at batch 8 1.08x (16 keys) to 1.33x (2,000 keys), level
    at batch 1 (docs/benchmarks.md).
    """
    heads, dim = q.shape[1], q.shape[2]
    qd = q if d.rows is None else q[d.rows]
    b = qd.shape[0]
    keys = _gather(k_cache, d.block_tables).flatten(1, 2)[:, : d.max_len]  # [B, L, Hkv, D]
    values = _gather(v_cache, d.block_tables).flatten(1, 2)[:, : d.max_len]
    if d.shared is not None:
        return _decode_shared(d, qd, keys, values, k_cache, v_cache)
    if k_cache.dtype == torch.float32:
        out = F.scaled_dot_product_attention(
            qd.reshape(b, heads, 1, dim), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=d.keep, enable_gqa=True,
        )
        return out.view(b, heads, dim)
    kv_heads = k_cache.shape[2]
    # query head h reads KV head h // (heads // kv_heads), as SDPA's enable_gqa does
    qg = qd.view(b, kv_heads, heads // kv_heads, dim).float() * (dim**-0.5)
    scores = _own_scores(qg, keys, d.keep)
    out = torch.matmul(scores.softmax(dim=-1), values.float().transpose(1, 2))  # [B, Hkv, G, D]
    return out.view(b, heads, dim).to(q.dtype)


def _own_scores(qg: torch.Tensor, keys: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Float32 scores ``[B, Hkv, G, L]`` of the scaled queries ``qg`` ``[B, Hkv, G, D]`` over
    each sequence's gathered ``keys`` ``[B, L, Hkv, D]``, ``-inf`` where ``keep`` is False."""
    scores = torch.matmul(qg, keys.float().permute(0, 2, 3, 1))
    if keep is not None:
        scores.masked_fill_(~keep, float("-inf"))
    return scores


def _decode_shared(
    d: _DecodeBatch, qd: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
) -> torch.Tensor:
    """Decode attention of ``B`` sequences whose tables start with the same ``d.shared``
    blocks (a cached system prompt), in float32: the shared keys are read once (in place when
    they are one run of blocks and float32), by one CPU flash call whose rows per KV head are
    every sequence's query heads; the rest of each context (``keys``/``values``: ``[B, L, Hkv,
    D]``, masked by ``d.keep``) as in the plain path; the two parts merged by their
    log-sum-exp. Gathering the shared prefix per sequence copied it ``B`` times per layer and
    step; the flash call over the in-place prefix takes 0.68-0.77x the time of the float32
    matmuls, log-sum-exp and softmax it replaced (docs/benchmarks.md)."""
    assert d.shared is not None
    b, heads, dim = qd.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    qg = qd.view(b, kv_heads, group, dim).float() * (dim**-0.5)  # [B, Hkv, G, D]
    rows = qg.transpose(0, 1).reshape(1, kv_heads, b * group, dim)  # [1, Hkv, B*G, D]
    o1, lse1 = _FLASH_CPU(rows, _shared(d, k_cache), _shared(d, v_cache), 0.0, False, scale=1.0)
    shared = (o1[0].view(kv_heads, b, group, dim).transpose(0, 1),  # [B, Hkv, G, D]
              lse1[0].view(kv_heads, b, group).transpose(0, 1))
    s2 = _own_scores(qg, keys, d.keep)  # [B, Hkv, G, L]
    lse2 = torch.logsumexp(s2, dim=-1)  # every sequence has a key of its own: finite
    o2 = torch.matmul(s2.softmax(dim=-1), values.float().transpose(1, 2))  # [B, Hkv, G, D]
    return _merged(shared, (o2, lse2)).reshape(b, heads, dim).to(qd.dtype)


def _shared(d: _DecodeBatch, cache: torch.Tensor) -> torch.Tensor:
    """The shared prefix's keys (or values) as float32 ``[1, Hkv, S, D]``: a view of the pool
    when its blocks are one run (and the pool is float32), else a copy."""
    assert d.shared is not None
    if d.shared_first is not None:
        part = cache[d.shared_first : d.shared_first + len(d.shared)]
    else:
        part = _gather(cache, d.shared)
    return part.flatten(0, 1).float().transpose(0, 1)[None]
