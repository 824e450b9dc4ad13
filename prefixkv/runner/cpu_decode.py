"""Decode steps on CPU without per-op dispatch: each layer as eleven C calls on raw addresses.

A decode step of a small model is bound by streaming its weights (the C matmul,
``models/cpu_gemv.py``, reaches the memory's bandwidth) plus the Python and dispatcher cost of
the module path: about 20 torch ops, wrappers and module calls a layer, 60-65 us, 2 ms of
SmolLM2's 11 ms step. This path runs the *same C functions* the module path reaches (the
fused RMSNorm / RoPE / SwiGLU of ``models/cpu_ops.py``, ``cpu_gemv``'s matmul, the attention
kernel of ``cpu_attention.py``) on the same values in the same order, so its hidden states
equal the module path's bit for bit (``tests/runner/test_cpu_decode.py``); only the dispatch
is gone: every weight's address is taken once (:meth:`CpuDecode.build`), and so are the
step's buffers (for ``MAX_ROWS`` rows) and the attention's layout checks; a step makes no torch
op (its token ids, positions and KV slots are int64 arrays read by address; the embedding rows
and RoPE's cos / sin come from C too), and a layer is eleven C calls (two of them the KV
writes; thirteen with Qwen3's q/k norms). The logits of its rows go through the output layer's
C matmul (:meth:`CpuDecode.logits`). Why no torch op: each costs 1-4 us, but 5-20 us on the
first step after a long prefill, whose data pushed the dispatcher's code and tables out of the
caches; a request whose prefix is cached is exactly such a step (docs/engine.md).

When: float32 on CPU, the three C extensions built and on, a Llama-family model (Qwen3's
q/k norms in place, per head, by ``cpu_ops``' row function, as in the module path) whose
matmuls all have C-readable packed weights (``cpu_pack.PackedWeight.address``), at most
``cpu_gemv.MAX_ROWS`` new tokens, and a step whose every sequence the attention kernel takes
(``PagedAttention.kernel_batch``). Otherwise :meth:`CpuDecode.run` returns ``None`` and the
runner takes the module path. ``PREFIXKV_CPU_DECODE=0`` turns this path off.

Ownership: a :class:`CpuDecode` holds addresses into the model's packed weights and norms and
into the KV pool, and references to the tensors that own them (the model and the pool), so
the addresses stay valid while it lives. The runner builds it after packing; nothing may
reload the model's weights afterwards (a packed layer cannot be loaded again anyway).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixkv.models import cpu_gemv, cpu_ops
from prefixkv.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, Linear, RMSNorm
from prefixkv.models.lora import LoRAStep
from prefixkv.runner import cpu_attention
from prefixkv.runner.attention import PagedAttention
from prefixkv.runner.kv_pool import KVPool

try:
    from prefixkv.models import _cpu_gemv, _cpu_ops
except ImportError:  # no compiler at install time: the module path only
    _cpu_gemv = _cpu_ops = None  # type: ignore[assignment]

ENABLED = os.environ.get("PREFIXKV_CPU_DECODE", "1") != "0"
"""Whether decode steps take this path where it fits; tests and benchmarks flip it."""


@dataclass(frozen=True, slots=True)
class _Matmul:
    weight: tuple[int, int, int, int]  # the packed weight's address, n, k and k_block (gemv's)
    bias: int  # 0: none


@dataclass(frozen=True, slots=True)
class _Layer:
    norm_in: int
    norm_post: int
    qkv: _Matmul
    o: _Matmul
    gate_up: _Matmul
    down: _Matmul
    q_norm: int  # Qwen3's per-head q / k RMSNorm weights (cpu_ops' row function on each
    k_norm: int  # head, as the module path runs it on [T, H, D]); 0: no q/k norm
    k_rows: torch.Tensor  # the layer's K pool as [slots, Hkv, D] (owns k_addr's memory)
    v_rows: torch.Tensor
    k_addr: int
    v_addr: int


def _matmul(linear: object) -> _Matmul | None:
    if not isinstance(linear, Linear):  # e.g. a 4-bit Int4Linear: not this path's
        return None
    p = linear.packed
    if p is None or not p.address or p.tensor.dtype != torch.float32:
        return None
    bias = linear.bias
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()):
        return None
    return _Matmul((p.address, p.out_features, p.in_features, p.k_block),
                   0 if bias is None else bias.data_ptr())


def _norm(norm: RMSNorm, width: int) -> int:
    w = norm.weight
    ok = w.dtype == torch.float32 and w.is_contiguous() and w.shape == (width,)
    return w.data_ptr() if ok else 0


class CpuDecode:
    """The per-layer addresses of one model and pool, and one step's buffers; :meth:`run`
    computes a step of up to ``cpu_gemv.MAX_ROWS`` tokens."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, layers: list[_Layer]) -> None:
        cfg = model.config
        self.model, self.pool, self.layers = model, pool, layers
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.final_norm = _norm(model.model.norm, self.hidden)
        self.embed = model.model.embed_tokens.weight  # [vocab, hidden], read by row
        self.inv_freq = model._inv_freq  # RoPE's, as the module path's cpu_ops.rope_cos_sin
        # The step's buffers, for MAX_ROWS rows (a step uses the first m): torch ops cost
        # 5-20 us each on the first step after a long prefill (the dispatcher's code and data
        # are out of the caches), so a step makes none but its result view.
        rows, width = cpu_gemv.MAX_ROWS, (self.heads + 2 * self.kv_heads) * self.dim
        f32 = torch.float32
        self._stream, self._other, self._normed = (
            torch.empty((rows, self.hidden), dtype=f32) for _ in range(3))
        self._qkv = torch.empty((rows, width), dtype=f32)
        self._out = torch.empty((rows, self.heads, self.dim), dtype=f32)
        self._gate_up = torch.empty((rows, 2 * self.inter), dtype=f32)
        self._act = torch.empty((rows, self.inter), dtype=f32)
        self._cos, self._sin = (torch.empty((rows, self.dim), dtype=f32) for _ in range(2))
        self._q = self._qkv[:, : self.heads * self.dim].view(rows, self.heads, self.dim)
        qkv = self._qkv.data_ptr()
        k_new = qkv + 4 * self.heads * self.dim  # the new K, then V, columns of qkv's rows
        v_new = k_new + 4 * self.kv_heads * self.dim
        self._addrs = (  # the buffers' addresses, as run() passes them: taken once
            self._stream.data_ptr(), self._other.data_ptr(), self._normed.data_ptr(), qkv, k_new,
            v_new, self._out.data_ptr(), self._gate_up.data_ptr(), self._act.data_ptr(),
            self._cos.data_ptr(), self._sin.data_ptr())
        self._views: dict[int, torch.Tensor] = {}  # m -> the first m rows of _normed
        self._lora_views: dict[int, tuple[torch.Tensor, ...]] = {}  # m -> each matmul's in / out
        self._lora_names = [tuple(f"model.layers.{i}.{m}" for m in (
            "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
            for i in range(cfg.num_hidden_layers)]  # the modules' names, as LoRAStep keys them
        self._k0 = pool.layer(0)[0]  # the attention kernel's strides (every layer's alike)
        self.output: _Matmul | None = None  # the output layer's C matmul (build sets it)

    @classmethod
    def build(cls, model: object, pool: KVPool) -> CpuDecode | None:
        """The path for ``model`` over ``pool``, or ``None`` where it does not apply (see the
        module docstring); call it after ``pack_weights()``."""
        if not (_cpu_gemv is not None and _cpu_ops is not None and cpu_gemv.ENABLED
                and cpu_ops.ENABLED and isinstance(model, LlamaForCausalLM)):
            return None
        cfg = model.config
        kv = pool.kv
        inv = model._inv_freq
        if (kv.dtype != torch.float32 or kv.device.type != "cpu"
                or not cpu_attention.usable(kv, cfg.head_dim) or cfg.head_dim % 32
                or cfg.hidden_size % 16 or cfg.intermediate_size % 16
                or model.model.embed_tokens.weight.dtype != torch.float32
                or not model.model.embed_tokens.weight.is_contiguous()
                or inv.dtype != torch.float32 or inv.device.type != "cpu"
                or inv.shape != (cfg.head_dim // 2,) or not inv.is_contiguous()):
            return None
        layers = []
        for i, layer in enumerate(model.model.layers):
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            assert isinstance(attn, Attention) and isinstance(mlp, MLP)
            qkv, o = _matmul(attn.qkv_proj), _matmul(attn.o_proj)
            gate_up, down = _matmul(mlp.gate_up_proj), _matmul(mlp.down_proj)
            norm_in = _norm(layer.input_layernorm, cfg.hidden_size)
            norm_post = _norm(layer.post_attention_layernorm, cfg.hidden_size)
            q_norm = 0 if attn.q_norm is None else _norm(attn.q_norm, cfg.head_dim)
            k_norm = 0 if attn.k_norm is None else _norm(attn.k_norm, cfg.head_dim)
            if (qkv is None or o is None or gate_up is None or down is None or not norm_in
                    or not norm_post or (attn.q_norm is None) != (attn.k_norm is None)
                    or (attn.q_norm is not None and not (q_norm and k_norm))):
                return None
            k_cache, v_cache = pool.layer(i)
            rows = (-1, cfg.num_key_value_heads, cfg.head_dim)
            layers.append(_Layer(
                norm_in=norm_in, norm_post=norm_post, qkv=qkv, o=o, gate_up=gate_up, down=down,
                q_norm=q_norm, k_norm=k_norm, k_rows=k_cache.view(rows), v_rows=v_cache.view(rows),
                k_addr=k_cache.data_ptr(), v_addr=v_cache.data_ptr(),
            ))
        made = cls(model, pool, layers)
        if not made.final_norm:
            return None
        if model.lm_head is not None:
            made.output = _matmul(model.lm_head)
        elif (tied := model._logits_packed) is not None and tied.address \
                and tied.tensor.dtype == torch.float32:
            made.output = _Matmul((tied.address, tied.out_features, tied.in_features,
                                   tied.k_block), 0)
        cpu_attention.check_layout(made._out, made._q, *pool.layer(0))  # every layer's alike
        return made

    def run(
        self, tokens: Sequence[int], positions: Sequence[int], attention: PagedAttention,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor | None:
        """Hidden states ``[T, hidden]`` (after the final norm) of a step's ``tokens`` at
        ``positions`` (ids checked by the caller; a bad one raises ``IndexError``), K/V written
        as the module path writes them; ``None`` (nothing done) when the step does not fit.
        ``lora``: the step's adapters, each matmul's delta added to its output buffer as
        ``Linear.forward`` adds it (``LoRAStep.apply``, the same ops on the same values).
        The result is a view of this object's buffer: read it before the next call."""
        batch = attention.kernel_batch()
        m = len(tokens)
        if not (ENABLED and batch is not None and 0 < m <= cpu_gemv.MAX_ROWS
                and batch.rows <= m and batch.num_blocks == self.pool.num_blocks
                and len(attention.slots) == m and len(positions) == m
                and cpu_gemv.ENABLED and cpu_ops.ENABLED):  # any C path off: this one too
            return None
        hid, inter, heads, kvh, dim = self.hidden, self.inter, self.heads, self.kv_heads, self.dim
        q_size, kv_size = heads * dim, kvh * dim
        width = q_size + 2 * kv_size
        ids, pos = array("q", tokens), array("q", positions)
        threads = torch.get_num_threads()
        gemv, rms, rope, silu = _cpu_gemv.gemv, _cpu_ops.rms_norm, _cpu_ops.rope, _cpu_ops.silu_mul
        scatter = _cpu_ops.scatter_rows
        (s_addr, o_addr, n_addr, qkv_addr, k_addr, v_addr, out_addr, gu_addr, act_addr, cos_addr,
         sin_addr) = self._addrs
        _cpu_ops.gather_rows(self.embed.data_ptr(), self.embed.shape[0], hid, ids.buffer_info()[0],
                             m, s_addr)  # the embedding rows
        _cpu_ops.rope_cos_sin(pos.buffer_info()[0], m, self.inv_freq.data_ptr(), dim // 2,
                              cos_addr, sin_addr, 1)
        slots_addr, pool_rows = attention.slots.buffer_info()[0], self.layers[0].k_rows.shape[0]
        eps = self.eps
        attend = cpu_attention.bind(self._out, self._q, self._k0, batch, threads)  # per layer:
        # its K / V addresses only
        add = None if lora is None else lora.apply  # and each matmul's rows it reads / adds to:
        v = () if lora is None else self._lora_views.get(m) or self._make_lora_views(m)
        for i, L in enumerate(self.layers):
            names = self._lora_names[i]
            # the stream is in `stream` (+ `other` from layer 1 on: the MLP's output and the
            # stream before it, added here as the module path adds them)
            rms(s_addr, hid, o_addr if i else 0, hid, n_addr, hid, L.norm_in, m, hid, eps, threads)
            gemv(*L.qkv.weight, n_addr, hid, qkv_addr, width, L.qkv.bias, m, threads)
            if add is not None:
                add(names[0], v[0], v[1])
            if L.q_norm:  # in place, per head
                rms(qkv_addr, width, 0, 0, qkv_addr, width, L.q_norm, m, dim, eps, threads, heads)
                rms(k_addr, width, 0, 0, k_addr, width, L.k_norm, m, dim, eps, threads, kvh)
            rope(qkv_addr, width, cos_addr, sin_addr, dim, m, heads + kvh, dim, threads)
            scatter(k_addr, width, L.k_addr, slots_addr, m, kv_size, pool_rows)  # the new K, V
            scatter(v_addr, width, L.v_addr, slots_addr, m, kv_size, pool_rows)  # into the pool
            attend(L.k_addr, L.v_addr)
            gemv(*L.o.weight, out_addr, q_size, o_addr, hid, L.o.bias, m, threads)
            if add is not None:
                add(names[1], v[2], v[3])
            rms(o_addr, hid, s_addr, hid, n_addr, hid, L.norm_post, m, hid, eps, threads)
            gemv(*L.gate_up.weight, n_addr, hid, gu_addr, 2 * inter, L.gate_up.bias, m, threads)
            if add is not None:
                add(names[2], v[0], v[4])
            silu(gu_addr, 2 * inter, act_addr, inter, m, inter, threads)
            gemv(*L.down.weight, act_addr, inter, s_addr, hid, L.down.bias, m, threads)
            if add is not None:
                add(names[3], v[5], v[6])
        rms(s_addr, hid, o_addr, hid, n_addr, hid, self.final_norm, m, hid, eps, threads)
        view = self._views.get(m)
        if view is None:
            view = self._views[m] = self._normed[:m]
        return view

    def _make_lora_views(self, m: int) -> tuple[torch.Tensor, ...]:
        """The first ``m`` rows of each matmul's input and output buffer: normed, qkv, the
        attention's output, o's (``other``), gate_up, the activation, down's (``stream``)."""
        q_size = self.heads * self.dim
        views = (self._normed[:m], self._qkv[:m], self._out[:m].view(m, q_size), self._other[:m],
                 self._gate_up[:m], self._act[:m], self._stream[:m])
        self._lora_views[m] = views
        return views

    def logits(self, hidden: torch.Tensor, ends: Sequence[int]) -> torch.Tensor | None:
        """float32 logits ``[len(ends), vocab]`` of each item's last row of ``hidden`` (the view
        :meth:`run` returned; ``ends`` as ``ModelRunner.hidden_states`` gives them) by the
        output layer's C matmul, or ``None`` (the caller's module path) when ``hidden`` is not
        this path's or the rows are not all of it or only its last."""
        m, out, normed = hidden.shape[0], self.output, self._addrs[2]
        if (out is None or hidden.data_ptr() != normed or not 0 < m <= cpu_gemv.MAX_ROWS
                or not (len(ends) == m or len(ends) == 1) or not cpu_gemv.ENABLED):
            return None
        rows = len(ends)
        logits = torch.empty((rows, out.weight[1]), dtype=torch.float32)
        x = normed + (m - rows) * self.hidden * 4  # every row, or the last
        _cpu_gemv.gemv(*out.weight, x, self.hidden, logits.data_ptr(), out.weight[1], out.bias,
                       rows, torch.get_num_threads())
        return logits
