"""LoRA adapters applied per token inside the decoder's matmuls, several in one batch.

An adapter is PEFT's directory (``adapter_config.json``: ``peft_type`` LORA, ``r``,
``lora_alpha``, ``use_rslora``, ``target_modules``; ``adapter_model.safetensors``: ``...layers.
{i}.{self_attn,mlp}.{q,k,v,o,gate,up,down}_proj.lora_{A,B}.weight``) or llama.cpp's GGUF LoRA
file (``models/lora_gguf.py``). :func:`load_adapter` maps either onto this decoder's fused
matmuls (q/k/v -> ``qkv_proj`` and gate/up -> ``gate_up_proj``, each a slice of the output),
scale folded into ``B``. Every rank up to ``max_rank`` and any subset of the seven
projections; DoRA, per-module rank/alpha patterns, trained biases, extra saved modules and
embedding/output-layer targets are refused (``ValueError`` naming them).

Each module an adapter targets holds one :class:`LoRAWeights`: its pieces' ``A`` stacked and
their scaled ``B`` side by side (each in its own output rows, zeros elsewhere), so a
module's delta is ``x A^T B^T``, a shrink and an expand, whatever it fuses. A step's rows run
every adapter of the step at once (:class:`LoRAStep`: one adapter, two matmuls; several, its
rows gathered per adapter and one ``bmm`` per shrink / expand over the groups, as vLLM's
punica and S-LoRA's kernels do, in torch ops; the stacked weights cached per adapter set by
:class:`LoRAStacks`). The module path reaches it through :func:`applied` (``Linear.forward``
adds it); the C decode path (``runner/cpu_decode.py``) calls :meth:`LoRAStep.apply` on its own
buffers after each matmul: the same ops on the same values.

``LoRAAdapter.digest`` is a sha256 of the weights and scales as loaded (by module, after the
scale is folded): the prefix cache keys an adapter's blocks by it (never by its name), so
different weights under one name never share KV, and the same weights from PEFT and from a
float32 GGUF are one digest.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from prefixkv.models.config import ModelConfig

if TYPE_CHECKING:
    from prefixkv.models.llama import CausalLM

__all__ = ["LoRAAdapter", "LoRAStacks", "LoRAStep", "LoRAWeights", "applied", "build_adapter",
           "load_adapter"]

_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}
TARGETS = (*_ATTN, "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (HF names)."""
SERIAL_ROWS = 32
"""Steps of at most this many rows (decodes) run their adapter matmuls on one thread: rows x
rank is too little work to share, and a parallel region's fork / join cost 8-14x the work
(110 us vs 8 us for an 8 x 576 x 48 product, 2 threads on a loaded 2-core machine)."""
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One module's adapter: ``a_t`` ``[in, R]``, ``b_t`` ``[R, out]`` (scaled; both
    contiguous): adds ``x a_t b_t`` to the module's output."""

    a_t: torch.Tensor
    b_t: torch.Tensor


@dataclass(frozen=True, slots=True, eq=False)
class LoRAAdapter:
    """A loaded adapter: its weights by module name (``model.layers.3.self_attn.qkv_proj``);
    ``rank`` is the largest of its pieces'."""

    name: str
    path: str
    rank: int
    digest: str
    modules: dict[str, LoRAWeights]


def _read_config(path: Path, max_rank: int) -> dict[str, Any]:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"lora adapter {str(path)!r}: cannot read adapter_config.json: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora adapter {str(path)!r}: adapter_config.json is not an object")
    problems = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
    for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern",
                "fan_in_fan_out", "layers_to_transform", "trainable_token_indices"):
        if config.get(key):
            problems.append(f"{key} is set")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append("trained biases")
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        problems.append(f"r={rank!r} (1..{max_rank}, --max-lora-rank)")
    if problems:
        raise ValueError(f"lora adapter {str(path)!r} is not supported: " + "; ".join(problems))
    return config


def _peft_pairs(root: Path, config: ModelConfig) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    weights_file = root / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"lora adapter {str(root)!r}: no adapter_model.safetensors")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        parts = key.split(".")
        try:
            at = parts.index("layers")
            layer, proj, which = int(parts[at + 1]), parts[at + 3], parts[at + 4]
        except (ValueError, IndexError):
            raise ValueError(f"lora adapter {str(root)!r}: tensor {key!r} targets no decoder "
                             "layer projection (embeddings and the output layer are not supported)") from None
        if proj not in TARGETS or which not in ("lora_A", "lora_B") or not 0 <= layer < config.num_hidden_layers:
            raise ValueError(f"lora adapter {str(root)!r}: tensor {key!r} does not fit this model")
        pairs.setdefault((layer, proj), {})["a" if which == "lora_A" else "b"] = tensor
    return pairs


def load_adapter(path: str | Path, model_config: ModelConfig, *, name: str, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> LoRAAdapter:
    """Load a PEFT LoRA directory or a GGUF LoRA file for a model of ``model_config``
    (``ValueError`` naming what does not fit: a module this decoder lacks, a shape, a layer
    past the model's, a rank past ``max_rank``)."""
    root = Path(path)
    if root.is_file():
        from prefixkv.models.lora_gguf import read_gguf_lora

        pairs, alpha = read_gguf_lora(root, model_config)
        return build_adapter(name, str(root), pairs, model_config, max_rank=max_rank, dtype=dtype,
                             device=device, scale=lambda r: alpha / r if alpha else 1.0)
    config = _read_config(root, max_rank)
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    peft_scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    pairs = _peft_pairs(root, model_config)
    for (layer, proj), ab in pairs.items():
        if "a" in ab and ab["a"].shape[0] != rank:
            raise ValueError(f"lora adapter {str(root)!r}: layer {layer} {proj} has rank "
                             f"{ab['a'].shape[0]}, adapter_config.json says r={rank}")
    return build_adapter(name, str(root), pairs, model_config, max_rank=max_rank, dtype=dtype,
                         device=device, scale=lambda r: peft_scale)


def build_adapter(name: str, source: str, pairs: dict[tuple[int, str], dict[str, torch.Tensor]],
                  model_config: ModelConfig, *, max_rank: int, dtype: torch.dtype,
                  device: torch.device | str, scale: Callable[[int], float]) -> LoRAAdapter:
    """An adapter from ``{(layer, hf projection): {"a": [r, in], "b": [out, r]}}`` in HF's
    layout; ``scale(r)`` is a piece's factor (folded into its ``b``)."""
    c = model_config
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    spans = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv),
             "o_proj": (0, c.hidden_size), "gate_proj": (0, inter), "up_proj": (inter, 2 * inter),
             "down_proj": (0, c.hidden_size)}
    widths = {"qkv_proj": q + 2 * kv, "o_proj": c.hidden_size, "gate_up_proj": 2 * inter,
              "down_proj": c.hidden_size}
    grouped: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    digest = hashlib.sha256()
    top = 0
    for (layer, proj), ab in sorted(pairs.items()):
        a, b = ab.get("a"), ab.get("b")
        if a is None or b is None:
            raise ValueError(f"lora adapter {source!r}: layer {layer} {proj} lacks lora_A or lora_B")
        rank = a.shape[0] if a.dim() == 2 else -1
        if not 1 <= rank <= max_rank:
            raise ValueError(f"lora adapter {source!r}: layer {layer} {proj} has rank {rank} "
                             f"(1..{max_rank}, --max-lora-rank)")
        start, stop = spans[proj]
        inputs = {"o_proj": q, "down_proj": inter}.get(proj, c.hidden_size)
        if a.shape != (rank, inputs) or b.shape != (stop - start, rank):
            raise ValueError(f"lora adapter {source!r}: layer {layer} {proj} has shapes "
                             f"{tuple(a.shape)} / {tuple(b.shape)}, expected "
                             f"{(rank, inputs)} / {(stop - start, rank)}")
        a32, b32 = a.float().contiguous(), (b.float() * float(scale(rank))).contiguous()
        digest.update(f"{layer}.{proj}:{rank};".encode())
        digest.update(a32.numpy().tobytes())
        digest.update(b32.numpy().tobytes())
        top = max(top, rank)
        grouped.setdefault(f"model.layers.{layer}.{'self_attn' if proj in _ATTN else 'mlp'}."
                           f"{_FUSED.get(proj, proj)}", []).append((start, stop, a32, b32))
    if not grouped:
        raise ValueError(f"lora adapter {source!r} has no LoRA weights")
    modules = {}
    for module, pieces in grouped.items():
        total = sum(a.shape[0] for _, _, a, _ in pieces)
        b_all = torch.zeros(widths[module.rsplit(".", 1)[1]], total)
        col = 0
        for start, stop, a, b in pieces:
            b_all[start:stop, col:col + a.shape[0]] = b
            col += a.shape[0]
        a_all = torch.cat([a for _, _, a, _ in pieces])
        modules[module] = LoRAWeights(a_all.t().to(device=device, dtype=dtype).contiguous(),
                                      b_all.t().to(device=device, dtype=dtype).contiguous())
    return LoRAAdapter(name, source, top, digest.hexdigest(), modules)


class LoRAStacks:
    """Every module's weights of a set of two or more adapters, stacked ``[G, in, R]`` /
    ``[G, R, out]`` (ranks padded with zeros; an adapter that skips a module has zeros there);
    the last ``capacity`` sets are kept (a decode batch keeps its set for many steps; a set
    costs about its adapters' size). The runner owns one."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._sets: OrderedDict[tuple[LoRAAdapter, ...], dict[str, tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()

    def get(self, adapters: tuple[LoRAAdapter, ...]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The stacks of ``adapters`` by module name (built on first use)."""
        got = self._sets.get(adapters)
        if got is None:
            got = self._sets[adapters] = self._build(adapters)
            while len(self._sets) > self.capacity:
                self._sets.popitem(last=False)
        else:
            self._sets.move_to_end(adapters)
        return got

    @staticmethod
    def _build(adapters: tuple[LoRAAdapter, ...]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for name in dict.fromkeys(n for ad in adapters for n in ad.modules):
            mine = [(g, ad.modules[name]) for g, ad in enumerate(adapters) if name in ad.modules]
            first = mine[0][1]
            rank = max(w.a_t.shape[1] for _, w in mine)
            a = first.a_t.new_zeros(len(adapters), first.a_t.shape[0], rank)
            b = first.b_t.new_zeros(len(adapters), rank, first.b_t.shape[1])
            for g, w in mine:
                a[g, :, :w.a_t.shape[1]] = w.a_t
                b[g, :w.b_t.shape[0]] = w.b_t
            out[name] = (a, b)
        return out


class LoRAStep:
    """The adapters of one step's flat token batch: ``spans[i] = (adapter or None, n_tokens)``
    in batch order. ``adapters``: the step's set; ``names``: every module one of them targets.

    One adapter: every row runs its shrink and expand (``mm``, ``addmm_``), base rows masked to
    zero between them. Several: each adapter's rows are gathered into a group (padded to the
    largest with a masked copy of its first row), one ``bmm`` shrinks and one expands every
    group with its own adapter, and ``index_add_`` puts each row's delta back: five ops a
    module whatever the number of adapters, and each row multiplies by its own adapter only.
    """

    def __init__(self, spans: Sequence[tuple[LoRAAdapter | None, int]], stacks: LoRAStacks,
                 device: torch.device | str = "cpu") -> None:
        groups: dict[LoRAAdapter, list[int]] = {}
        offset = 0
        for adapter, n in spans:
            if adapter is not None:
                groups.setdefault(adapter, []).extend(range(offset, offset + n))
            offset += n
        self.adapters = tuple(sorted(groups, key=id))  # one stack per set, whatever the order
        rows = [groups[a] for a in self.adapters]
        self._index: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        if len(rows) == 1:
            self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
                n: (w.a_t, w.b_t) for n, w in self.adapters[0].modules.items()}
            if len(rows[0]) != offset:
                on = torch.zeros(offset, 1)
                on[rows[0]] = 1.0
                self._mask = on.to(device)
        else:
            self._stacks = stacks.get(self.adapters)
            width = max(len(r) for r in rows)
            self._index = torch.tensor([r + r[:1] * (width - len(r)) for r in rows],
                                       dtype=torch.long, device=device).view(-1)
            if any(len(r) != width for r in rows):
                self._mask = torch.tensor([[[1.0]] * len(r) + [[0.0]] * (width - len(r))
                                           for r in rows], device=device)
        self.names = set(self._stacks)

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (module ``name``'s output for the rows ``x``) with each row's own adapter's
        delta added in place (a row without one, or whose adapter skips ``name``, adds zeros)."""
        stack = self._stacks.get(name)
        if stack is None:
            return y
        a, b = stack
        threads = torch.get_num_threads()
        if 1 < threads and x.shape[0] <= SERIAL_ROWS:
            torch.set_num_threads(1)
        try:
            if self._index is None:
                h = torch.mm(x, a)
                if self._mask is not None:
                    h.mul_(self._mask.to(h.dtype))
                return y.addmm_(h, b)
            h = torch.bmm(x.index_select(0, self._index).view(a.shape[0], -1, x.shape[1]), a)
            if self._mask is not None:
                h.mul_(self._mask.to(h.dtype))
            return y.index_add_(0, self._index, torch.bmm(h, b).view(-1, y.shape[1]))
        finally:
            torch.set_num_threads(threads)


@contextmanager
def applied(model: CausalLM, step: LoRAStep) -> Iterator[None]:
    """Hang ``step`` on every :class:`~prefixkv.models.llama.Linear` that one of its adapters
    targets, for the duration of the block (the model then adds the deltas in its forward)."""
    from prefixkv.models.llama import Linear

    hooked: list[Linear] = []
    for name, module in model.named_modules():
        if name in step.names and isinstance(module, Linear):
            module.lora = (step, name)
            hooked.append(module)
    if len(hooked) != len(step.names):  # e.g. 4-bit GGUF matmuls: never run the base model silently
        for module in hooked:
            module.lora = None
        raise ValueError("this model's matmuls cannot take LoRA adapters (quantized weights?)")
    try:
        yield
    finally:
        for module in hooked:
            module.lora = None
