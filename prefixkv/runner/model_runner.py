"""The model runner: a loaded model, its tokenizer and the paged KV pool, stepped by the engine.

Ownership: the runner owns the model weights and the KV tensors. It does not know which block
belongs to whom: every :class:`RunItem` carries its own block table, and the engine (with its
``BlockPool`` and prefix index) decides which ids are free, cached or in use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch

from prefixkv.models.config import ModelConfig
from prefixkv.models.llama import CausalLM, Linear
from prefixkv.models.loader import load_model, load_tokenizer, resolve_device, resolve_dtype
from prefixkv.models.lora import LoRAAdapter, LoRAStacks, LoRAStep, applied, load_adapter
from prefixkv.runner.attention import PagedAttention
from prefixkv.runner.cpu_decode import CpuDecode
from prefixkv.runner.kv_pool import KVPool
from prefixkv.runner.kv_transfer import model_fingerprint

DEFAULT_MAX_SEQS_IN_POOL = 4
"""Without an explicit size the pool holds this many full-length (``max_model_len``) sequences..."""
DEFAULT_KV_CACHE_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}
"""...capped by this many bytes per device type (other device types use the CPU figure), but
never below one full-length sequence (a request of ``max_model_len`` tokens always fits)."""


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads of one core count once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = (topo / "core_id").read_text().strip()
            package = (topo / "physical_package_id").read_text().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return max(1, len(cores))


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op threads; returns the number in effect.

    ``threads`` given: exactly that many. ``None``: the physical cores, but never more than
    torch already uses, so an explicit ``OMP_NUM_THREADS`` / ``torch.set_num_threads`` that
    asked for fewer is kept (and hyper-threads are not oversubscribed).
    """
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        torch.set_num_threads(threads)
        return threads
    current = torch.get_num_threads()
    wanted = min(physical_cores(), current)
    if "OMP_NUM_THREADS" not in os.environ and wanted != current:
        torch.set_num_threads(wanted)
    return torch.get_num_threads()


@dataclass(slots=True)
class RunItem:
    """One sequence's work in a step.

    ``token_ids``: the tokens to compute now (a prefill chunk, or one token for a decode).
    ``start_pos``: how many tokens of the sequence are already in the KV cache; the new tokens
    take positions ``start_pos, start_pos + 1, ...``.
    ``block_table``: block ids covering positions ``[0, start_pos + len(token_ids))`` (extra
    trailing entries are allowed and ignored).
    ``lora``: the adapter its tokens run with (items of one step may each have their own).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    lora: LoRAAdapter | None = None  # the item's LoRA adapter (models/lora.py); None: base


class ModelRunner:
    """Runs the model over paged KV for a batch of :class:`RunItem`.

    ``num_kv_blocks`` sizes the pool directly; otherwise ``kv_cache_memory_bytes`` gives a budget
    in bytes; with neither, the pool holds ``DEFAULT_MAX_SEQS_IN_POOL`` sequences of
    ``max_model_len`` tokens, capped by ``DEFAULT_KV_CACHE_BYTES`` for the device type but
    never below one ``max_model_len`` sequence. ``model_path``: an HF directory or a ``.gguf``
    file. ``threads``: torch CPU threads (see :func:`configure_threads`). ``fingerprint`` is
    :func:`~prefixkv.runner.kv_transfer.model_fingerprint` of the weights as loaded.
    ``max_model_len`` (default: the model's ``max_position_embeddings``) may only shrink the
    context; ``tokenizer`` is a directory to load the tokenizer from instead of the model's.
    ``quantization="gguf"`` keeps a GGUF's Q4 matmul weights at 4 bits (models/quant_linear).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        threads: int | None = None,
        max_model_len: int | None = None,
        tokenizer: str | Path | None = None,
        quantization: str | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_kv_blocks is not None and kv_cache_memory_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory_bytes, not both")
        self.threads = configure_threads(threads)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model: CausalLM = load_model(
            model_path, device=self.device, dtype=self.dtype, quantization=quantization
        )
        # The fingerprint reads weight values: take it before packing drops the plain copies.
        self.fingerprint = model_fingerprint(self.model)
        self.packed_weights = self.model.pack_weights()  # CPU: oneDNN layout (models/cpu_pack)
        self.config: ModelConfig = self.model.config
        self.tokenizer = load_tokenizer(model_path if tokenizer is None else tokenizer)
        self.block_size = block_size
        self.max_model_len = self.config.max_position_embeddings
        if max_model_len is not None:
            if not isinstance(max_model_len, int) or not 1 <= max_model_len <= self.max_model_len:
                raise ValueError(
                    f"max_model_len must be an int in [1, {self.max_model_len}] (the model's "
                    f"max_position_embeddings), got {max_model_len!r}"
                )
            self.max_model_len = max_model_len
        cfg = self.config
        per_block = KVPool.bytes_per_block(
            num_layers=cfg.num_hidden_layers,
            block_size=block_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
        )
        if num_kv_blocks is None:
            if kv_cache_memory_bytes is None:
                budget = DEFAULT_KV_CACHE_BYTES.get(self.device.type, DEFAULT_KV_CACHE_BYTES["cpu"])
                full = -(-self.max_model_len // block_size)  # one max_model_len sequence
                num_kv_blocks = max(full, min(DEFAULT_MAX_SEQS_IN_POOL * full, budget // per_block))
            else:
                num_kv_blocks = kv_cache_memory_bytes // per_block
                if num_kv_blocks < 1:
                    raise ValueError(
                        f"kv_cache_memory_bytes={kv_cache_memory_bytes} is below one block "
                        f"({per_block} bytes)"
                    )
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
        self.num_kv_blocks = num_kv_blocks
        self.kv_pool = KVPool(
            num_layers=cfg.num_hidden_layers,
            num_blocks=num_kv_blocks,
            block_size=block_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        # CPU float32: decode steps as raw C calls (cpu_decode.py); None where it cannot apply
        self.cpu_decode = CpuDecode.build(self.model, self.kv_pool)
        self._lora_stacks = LoRAStacks()  # steps' adapter sets, stacked (models/lora.py)

    def execute(self, items: list[RunItem]) -> torch.Tensor:
        """Compute ``items``' new tokens; float32 logits ``[len(items), vocab]`` of each last one.

        Writes the K/V of position ``p`` of an item into slot
        ``block_table[p // block_size] * block_size + p % block_size``. Items may mix prefill
        chunks and single-token decodes. Two items must not write the same slot.
        """
        with torch.inference_mode():
            return self.last_logits(*self.hidden_states(items))

    def last_logits(self, hidden: torch.Tensor, ends: list[int]) -> torch.Tensor:
        """float32 logits ``[len(ends), vocab]`` of each item's last row of ``hidden`` (as
        :meth:`hidden_states` returns them; call it under ``torch.inference_mode()``)."""
        fast = self.cpu_decode.logits(hidden, ends) if self.cpu_decode is not None else None
        if fast is not None:  # the C decode path's rows: its output matmul, no module call
            return fast
        if len(ends) == hidden.shape[0]:  # one new token an item (decodes): every row
            last = hidden
        elif len(ends) == 1:
            last = hidden[-1:]
        else:
            last = hidden[torch.tensor(ends, device=self.device) - 1]
        logits = self.model.compute_logits(last)
        return logits if logits.dtype is torch.float32 else logits.float()

    def hidden_states(self, items: list[RunItem]) -> tuple[torch.Tensor, list[int]]:
        """The model over ``items`` (validated; K/V written as :meth:`execute` says): the hidden
        states of every new token, flat ``[tokens, hidden]``, and each item's end offset in
        them. Call it under ``torch.inference_mode()``; :meth:`execute` and the prompt-logits
        step (``runner/prompt_logits.py``) are the callers. The hidden states may be a view of
        the C decode path's buffer (``cpu_decode.py``): read them before the next step."""
        if not items:
            raise ValueError("items must not be empty")
        tokens: list[int] = []
        positions: list[int] = []
        for i, item in enumerate(items):
            self._validate(i, item)
            tokens.extend(item.token_ids)
            positions.extend(range(item.start_pos, item.start_pos + len(item.token_ids)))
        attention = PagedAttention(
            self.kv_pool,
            start_positions=[it.start_pos for it in items],
            query_lens=[len(it.token_ids) for it in items],
            block_tables=[it.block_table for it in items],
        )
        lora = (LoRAStep([(it.lora, len(it.token_ids)) for it in items], self._lora_stacks,
                         self.device) if any(it.lora is not None for it in items) else None)
        hidden = (self.cpu_decode.run(tokens, positions, attention, lora)
                  if self.cpu_decode else None)
        if hidden is None:
            input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            if lora is None:
                hidden = self.model(input_ids, pos, attention)
            else:
                with applied(self.model, lora):
                    hidden = self.model(input_ids, pos, attention)
        return hidden, list(accumulate(len(it.token_ids) for it in items))

    def load_lora(self, path: str | Path, *, name: str, max_rank: int) -> LoRAAdapter:
        """A PEFT LoRA directory or GGUF LoRA file loaded for this model (``ValueError`` if it
        does not fit)."""
        adapter = load_adapter(path, self.config, name=name, max_rank=max_rank,
                               dtype=self.dtype, device=self.device)
        modules = dict(self.model.named_modules())
        missing = [n for n in adapter.modules if not isinstance(modules.get(n), Linear)]
        if missing:
            raise ValueError(f"lora adapter {name!r}: this model cannot apply it to {missing[0]} "
                             "(quantized matmuls take no adapters)")
        return adapter

    def copy_block_rows(self, src_block: int, dst_block: int, num_rows: int) -> None:
        """Copy the first ``num_rows`` KV rows of ``src_block`` into ``dst_block`` (all layers)."""
        self.kv_pool.copy_rows(src_block, dst_block, num_rows)

    def _validate(self, i: int, item: RunItem) -> None:
        n = len(item.token_ids)
        if n == 0:
            raise ValueError(f"items[{i}].token_ids must not be empty")
        if item.start_pos < 0:
            raise ValueError(f"items[{i}].start_pos must be >= 0, got {item.start_pos}")
        end = item.start_pos + n
        if end > self.max_model_len:
            raise ValueError(
                f"items[{i}] reaches position {end}, beyond max_model_len={self.max_model_len}"
            )
        needed = -(-end // self.block_size)
        if len(item.block_table) < needed:
            raise ValueError(
                f"items[{i}].block_table has {len(item.block_table)} blocks, "
                f"{needed} needed for {end} positions"
            )
        bad = [b for b in item.block_table[:needed] if not 0 <= b < self.num_kv_blocks]
        if bad:
            raise ValueError(
                f"items[{i}].block_table has ids outside [0, {self.num_kv_blocks}): {bad}"
            )
        vocab = self.config.vocab_size
        if min(item.token_ids) < 0 or max(item.token_ids) >= vocab:
            raise ValueError(f"items[{i}].token_ids has ids outside [0, {vocab})")
