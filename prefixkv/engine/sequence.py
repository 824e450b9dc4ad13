"""Requests and their sequences: the per-request state the scheduler and engine share.

A :class:`Request` is what a caller submitted (one prompt, one :class:`SamplingParams`); it owns
``n`` :class:`Sequence` objects, one per sample. The scheduler moves sequences between its
queues; the KV manager owns their block tables; the engine appends tokens. Text, stop decisions
and outputs are the :class:`~prefixkv.engine.output_processor.OutputProcessor`'s.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from prefixkv.cache.protocol import PrefixMatch, PrefixNode
from prefixkv.engine.outputs import PromptLogprobs, RequestMetrics
from prefixkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefixkv.models.lora import LoRAAdapter


class GrammarLike(Protocol):
    """A structured-output grammar state (``accept`` a token; ``is_done`` when complete)."""

    def accept(self, token_id: int) -> None: ...

    def is_done(self) -> bool: ...


class SequenceStatus(Enum):
    """Where a sequence is: queued, holding KV blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One submitted prompt and its samples.

    ``namespace`` is the prefix-index partition: ``(cache_salt, lora_id)`` collapsed to ``None``
    when both are ``None``, so tenants with different salts never share cached blocks.
    ``max_tokens`` is resolved at submission (``params.max_tokens`` or the room left in the
    model's context).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    namespace: Hashable | None
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int | None = None
    num_external_cached_tokens: int = 0
    num_external_queried_tokens: int = 0
    num_external_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    prompt_prefilled: bool = False
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    lora: LoRAAdapter | None = None  # its adapter (held while it runs; models/lora.py)

    @property
    def finished(self) -> bool:
        """Whether every sample is done."""
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the prompt must still be computed (not read from the cache) for its logprobs."""
        return self.params.prompt_logprobs is not None and not self.prompt_prefilled

    @property
    def read_limit(self) -> int | None:
        """How many leading prompt tokens admission may read from the prefix cache or a lower
        tier until the prompt has been prefilled once: 0 with ``skip_reading_prefix_cache``,
        ``prompt_logprobs_start`` with prompt logprobs (the positions after it are computed
        for them), ``None``: as many as are cached."""
        p = self.params
        if self.prompt_prefilled:
            return None
        if p.skip_reading_prefix_cache:
            return 0
        return p.prompt_logprobs_start if p.prompt_logprobs is not None else None

    @property
    def computes_prompt(self) -> bool:
        """Whether the whole prompt must be computed (:attr:`read_limit` 0)."""
        return self.read_limit == 0


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample's tokens, KV bookkeeping and status.

    KV bookkeeping (owned by :class:`~prefixkv.engine.kv_manager.KVManager`):
    ``block_table[i]`` holds the KV of tokens ``[i*bs, (i+1)*bs)``; the first
    ``num_indexed_blocks`` entries are held by the prefix index and locked by ``cache_handle``;
    the rest are private to this sequence. ``num_computed_tokens`` leading tokens have KV.
    Sampling state the sampler reads: ``generator`` (seeded requests) and ``grammar``
    (structured outputs, advanced with every appended token). ``finish_reason`` is set when it
    stops (by the output processor, or ``"abort"`` / ``"error"`` by the engine and scheduler).
    """

    seq_id: int
    request: Request
    index: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_indexed_blocks: int = 0
    tier_tokens: tuple[int, int] = (0, 0)  # (looked up, loaded) in lower tiers at admission
    tier_loaded: tuple[tuple[str, int], ...] = ()  # (tier, tokens) loaded from each at admission
    cache_handle: PrefixMatch | PrefixNode | None = None
    generator: object | None = None
    grammar: GrammarLike | None = None
    finish_reason: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """The generated ids."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many ids were generated."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet (>= 1 while running)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Whether prompt tokens are still uncomputed."""
        return self.num_computed_tokens < self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        """Add a sampled token (and advance the grammar, if any)."""
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
