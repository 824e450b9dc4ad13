"""Result records: what ``LLM.generate`` returns and ``AsyncEngine.generate`` streams.

All are snapshots: the engine builds new ones each time it reports, so a caller may keep them.
Times are engine clock values (``time.time`` unless another clock was passed in).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixkv.cache.protocol import CacheStats
from prefixkv.tiers.stats import TierStats


@dataclass(frozen=True, slots=True)
class Logprob:
    """Log-probability of one token at one position (vLLM's ``Logprob``).

    ``rank`` is the token's place in that position's distribution (1 = most likely);
    ``decoded_token`` is the text the token adds in its context, as vLLM's: ``""`` for a token
    that leaves a multi-byte character incomplete, the whole character on the one completing
    it (joined, a sample's token texts give its text, stops aside); a special token shows as
    itself.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token: the chosen id and the top alternatives, each with its :class:`Logprob`."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token; the first entry is ``None`` (nothing precedes the first token)."""


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: which of the request's ``n`` samples this is.
        text: the decoded text so far (cumulative; stop strings cut off).
        token_ids: the generated ids so far (cumulative).
        finish_reason: ``None`` while running, else ``"stop"`` (EOS, stop string or stop token),
            ``"length"`` (max_tokens or the context limit), ``"abort"`` (aborted by the caller)
            or ``"error"`` (the request failed: see :attr:`RequestOutput.error`).
        stop_reason: the stop string or stop token id that ended it (``None`` for EOS/length).
        delta_text: text added since the previous report of this request (streaming).
        delta_token_ids: ids added since the previous report of this request.
        logprobs: with ``SamplingParams.logprobs`` set, one dict per generated token: the
            chosen id and the top ``logprobs`` ids (so ``logprobs`` or ``logprobs + 1``
            entries); ``None`` otherwise. ``logprobs[-len(delta_token_ids):]`` are the new ones.
        cumulative_logprob: the sum of the chosen tokens' log-probabilities (with logprobs).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        """Whether this sample is done."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one request (engine clock). TTFT is ``first_token_time - arrival_time``."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token, or ``None`` before it."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to finish, or ``None`` while running."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def phases(self) -> dict[str, float]:
        """vLLM's request phases in seconds, those reached: ``queue`` (arrival to first step),
        ``prefill`` (first step to first token), ``decode`` (first to last token),
        ``inference`` (first step to last token); never negative."""
        spans = {"queue": (self.arrival_time, self.first_scheduled_time),
                 "prefill": (self.first_scheduled_time, self.first_token_time),
                 "decode": (self.first_token_time, self.finished_time),
                 "inference": (self.first_scheduled_time, self.finished_time)}
        return {name: max(0.0, b - a) for name, (a, b) in spans.items()
                if a is not None and b is not None}


@dataclass(slots=True)
class RequestOutput:
    """The state of one request (vLLM's ``RequestOutput``).

    Attributes:
        request_id: the id given at submission (or generated).
        prompt: the prompt text, if the prompt was given as text.
        prompt_token_ids: the tokenized prompt.
        outputs: one :class:`CompletionOutput` per sample, by index.
        finished: whether every sample is done.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache at the request's
            first scheduling (full cached blocks plus copied partial-block rows).
        num_external_cached_tokens: of those, the tokens loaded from a lower tier (host,
            disk, remote), vLLM's "external" prefix-cache hits; ``num_external_queried_tokens``
            the tokens looked up there (the full blocks after the pool's match);
            ``num_external_cached_tokens_by_tier`` the loaded ones by tier (``host``, ``disk``,
            ``remote``; a tier that gave none is absent).
        metrics: timings.
        error: why the request failed (finished, every sample's ``finish_reason`` is
            ``"error"``), else ``None``. A failure is the request's alone: its blocks are freed
            and every other request goes on.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` set, one entry per prompt
            token (``None`` for the first); always computed, never read from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_external_cached_tokens: int = 0
    num_external_queried_tokens: int = 0
    num_external_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def arrival_time(self) -> float:
        """When the request was submitted."""
        return self.metrics.arrival_time

    @property
    def first_token_time(self) -> float | None:
        """When the first token was generated."""
        return self.metrics.first_token_time

    @property
    def finished_time(self) -> float | None:
        """When the last sample finished."""
        return self.metrics.finished_time

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds."""
        return self.metrics.time_to_first_token


class RequestFailedError(RuntimeError):
    """A request failed on its own (the model or sampler raised for it, or it can never be
    scheduled); the engine and every other request go on. ``request_id`` names it and
    ``request_caused`` says whether the request itself is the cause (the server reports these
    as 500 marked request-caused, so a router does not retry them elsewhere) or the failure
    was capacity (e.g. pinned blocks fill the pool: worth retrying on another worker)."""

    def __init__(self, request_id: str, message: str, *, request_caused: bool = True) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.request_caused = request_caused


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine: queues, KV blocks and counters since start.

    ``num_free_blocks`` counts ids in the pool's free list; ``cache`` is ``None`` with prefix
    caching off. ``prefix_cache_hit_rate`` is cached prompt tokens over scheduled prompt tokens
    (from every tier). ``tiers``: per-tier counters (pool, host, disk, remote; docs/tiers.md),
    ``None`` without lower tiers.
    """

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_evictable_blocks: int
    block_size: int
    enable_prefix_caching: bool
    num_requests_finished: int
    num_requests_failed: int
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    num_steps: int
    prefix_cache_hit_rate: float
    cache: CacheStats | None
    tiers: list[TierStats] | None = None
