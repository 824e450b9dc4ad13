"""SamplingParams: how one request is sampled and when it stops (vLLM's names and defaults).

Validated once at construction: a bad value raises ``ValueError`` naming the field. The
object is frozen; ``stop`` and ``stop_token_ids`` are normalised to tuples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass, field, replace

from prefixkv.cache.retention import Retention
from prefixkv.engine.stop_regex import StopRegex, compile_stop_regex
from prefixkv.engine.structured_output import StructuredOutputsParams

_MIN_SEED = -(2**63)  # the range torch.Generator.manual_seed accepts
_MAX_SEED = 2**64 - 1
MAX_LOGPROB_TOKEN_IDS = 128
"""Most ``logprob_token_ids`` a request may give (vLLM's limit)."""
MAX_LOGIT_BIAS = 100.0
"""``logit_bias`` values are clamped to ``[-100, 100]`` (OpenAI's range)."""
MAX_STOP_STRINGS = 64
"""Most ``stop`` strings one request may give (OpenAI allows 4; each is searched every step)."""
MAX_STOP_CHARS = 4096
"""Most characters all of one request's ``stop`` strings may hold together."""
MAX_STOP_TOKEN_IDS = 1024
"""Most ``stop_token_ids`` one request may give."""
MAX_LOGIT_BIAS_TOKENS = 1024
"""Most ``logit_bias`` entries one request may give."""


def check_logit_bias_size(bias: Sized) -> None:
    """``ValueError`` if ``bias`` holds more than :data:`MAX_LOGIT_BIAS_TOKENS` entries (the
    servers call it before they validate any entry)."""
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS_TOKENS} entries, got {len(bias)}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping settings for one request.

    Attributes:
        n: samples per prompt (they share the prompt's cached KV blocks).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; -1 or 0 disables it.
        seed: per-request seed (sample ``i`` of ``n`` uses ``seed + i``); ``None`` draws from
            the engine's generator.
        max_tokens: most tokens to generate; ``None`` means up to the model's context length.
        stop: strings that end generation; the matched string is not part of the text.
        stop_regex: regular expressions (SGLang's field; Python ``re`` syntax, run by the
            ``regex`` package) that end generation when one matches the output text; unlike
            ``stop``, the text keeps everything up to the end of the token that completed the
            match, and ``stop_reason`` is the pattern (SGLang's ``matched``). At most
            :data:`MAX_STOP_REGEX` patterns of :data:`MAX_STOP_REGEX_LEN` characters each; a
            request whose searches take longer than :data:`STOP_REGEX_STEP_BUDGET_S` in one
            engine step (all its samples and patterns together) fails alone.
        stop_token_ids: token ids that end generation (the id stays in ``token_ids``); at most
            :data:`MAX_STOP_TOKEN_IDS`. ``stop`` holds at most :data:`MAX_STOP_STRINGS` strings
            of :data:`MAX_STOP_CHARS` characters together.
        ignore_eos: keep generating past the EOS token.
        skip_special_tokens: leave special tokens out of the decoded text.
        presence_penalty: subtracted once from the logit of every token already generated
            (in ``[-2, 2]``; positive discourages repeats).
        frequency_penalty: subtracted from a token's logit per time it was generated
            (in ``[-2, 2]``).
        repetition_penalty: > 0; tokens seen in the prompt or the output have positive logits
            divided by it and negative ones multiplied (1 disables it).
        logit_bias: ``{token_id: bias}`` added to the logits (biases clamped to [-100, 100]; at
            most :data:`MAX_LOGIT_BIAS_TOKENS` entries).
        allowed_token_ids: only these ids may be sampled (vLLM's field; every other logit is
            set to -inf before the other processing).
        min_p: in ``[0, 1]``: drop tokens less likely than ``min_p`` times the most likely one
            (after temperature).
        min_tokens: generate at least this many tokens: EOS and ``stop_token_ids`` are masked
            and stop strings are not checked until then.
        logprobs: return the log-probability of each generated token and of the ``logprobs``
            most likely tokens at that step (0: only the chosen one). Log-probabilities are
            those of the model's output distribution (after any structured-output mask, before
            penalties and temperature; vLLM's default ``raw_logprobs``).
        prompt_logprobs: also return them for every prompt token after the first. A request
            that asks for them does not read its prompt from the prefix cache (vLLM does the
            same), so they are computed, never skipped; it still fills the cache for others.
        prompt_logprobs_start: with ``prompt_logprobs``, the prompt position they start after
            (SGLang's ``logprob_start_len``): up to this many leading prompt tokens are read
            from the prefix cache, and the entries of positions ``<= prompt_logprobs_start``
            are ``None`` whatever the cache held. 0 (the default): every token after the first.
        logprob_token_ids: with ``logprobs`` (0 when unset), also the log-probability and rank
            of each of these ids at every generated position (and every prompt position with
            ``prompt_logprobs``): vLLM's field for scoring a fixed label set; at most
            :data:`MAX_LOGPROB_TOKEN_IDS` ids.
        include_stop_str_in_output: keep the matched stop string (or the stop token's text)
            in ``text``.
        structured_outputs: constrain the output to a JSON schema, any JSON object, a regex,
            a choice or a Lark grammar (see :class:`StructuredOutputsParams`).
        detokenize: ``False``: token ids only (vLLM's field): ``text`` stays empty and logprobs
            carry no ``decoded_token``; stop strings need text, so they are refused.
        skip_reading_prefix_cache: compute the whole prompt, reading nothing from the prefix
            cache or a lower tier (vLLM's field; the prompt still fills the cache for later
            requests). ``None`` or ``False``: read it, unless ``prompt_logprobs`` is set.
        retention: keep the prompt's cached prefix (and what the request caches) a while:
            a :class:`~prefixkv.cache.Retention` (priority 0-100, TTL renewed by every hit;
            docs/cache.md, "Retention"); ``None``: the eviction policy alone.
        cache_key: OpenAI's ``prompt_cache_key`` or a session id: hit rates are kept per key
            (``LLMEngine.cache_admin.hit_rates()``); at most 1,024 characters.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    skip_reading_prefix_cache: bool | None = None
    detokenize: bool = True
    allowed_token_ids: Sequence[int] | None = None
    stop_regex: str | Sequence[str] | None = None
    logprob_token_ids: Sequence[int] | None = None
    retention: Retention | None = None
    cache_key: str | None = None
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _stop_regex: tuple[StopRegex, ...] = field(default=(), init=False, repr=False, compare=False)
    _stop_ids: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _bias: tuple[tuple[int, float], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive int, got {self.top_k!r}")
        if self.seed is not None and not (
            _is_int(self.seed) and _MIN_SEED <= self.seed and self.seed + self.n - 1 <= _MAX_SEED
        ):
            raise ValueError(
                f"seed must be an int in [{_MIN_SEED}, {_MAX_SEED} - (n - 1)] or None "
                f"(sample i uses seed + i), got {self.seed!r}"
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")  # noqa: TRY004
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")  # noqa: TRY004
        stop = self.stop
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, Sequence):
            stops = tuple(stop)
        else:
            raise ValueError(f"stop must be a str, a list of str or None, got {stop!r}")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        if sum(len(s) if isinstance(s, str) else 0 for s in stops) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings hold at most {MAX_STOP_CHARS} characters together")
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must hold non-empty strings, got {stop!r}")
        ids = self.stop_token_ids
        if ids is None:
            stop_ids: tuple[int, ...] = ()
        elif isinstance(ids, Sequence) and not isinstance(ids, str):
            stop_ids = tuple(ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of ints or None, got {ids!r}")
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}")
        if not all(_is_int(t) and t >= 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must hold ints >= 0, got {ids!r}")
        object.__setattr__(self, "_stop", stops)
        object.__setattr__(self, "_stop_ids", stop_ids)
        object.__setattr__(self, "_stop_regex", compile_stop_regex(self.stop_regex))
        self._check_extensions()

    def _check_extensions(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {v!r}")
        if not _is_int(self.prompt_logprobs_start) or self.prompt_logprobs_start < 0:
            raise ValueError(f"prompt_logprobs_start must be an int >= 0, got {self.prompt_logprobs_start!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(  # noqa: TRY004
                f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}"
            )
        allowed = self.allowed_token_ids
        if allowed is not None and (
            isinstance(allowed, (str, bytes)) or not isinstance(allowed, Sequence) or not allowed
            or not all(_is_int(t) and t >= 0 for t in allowed)
        ):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (ints >= 0), got {allowed!r}")
        ids = self.logprob_token_ids
        if ids is not None:
            if (isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids
                    or len(ids) > MAX_LOGPROB_TOKEN_IDS or not all(_is_int(t) and t >= 0 for t in ids)):
                raise ValueError(f"logprob_token_ids must be a list of 1 to {MAX_LOGPROB_TOKEN_IDS} token "
                                 f"ids (ints >= 0), got {ids!r}")
            if self.logprobs is None:
                object.__setattr__(self, "logprobs", 0)  # (vLLM: they imply sample logprobs)
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be a bool, got {self.detokenize!r}")  # noqa: TRY004
        if not self.detokenize and (self._stop or self._stop_regex):
            raise ValueError("stop strings and stop_regex need detokenize=True (they are matched "
                             "in the text)")
        skip = self.skip_reading_prefix_cache
        if skip is not None and not isinstance(skip, bool):
            raise ValueError(f"skip_reading_prefix_cache must be a bool or None, got {skip!r}")  # noqa: TRY004
        if self.retention is not None and not isinstance(self.retention, Retention):
            raise ValueError(f"retention must be a Retention or None, got {self.retention!r}")
        key = self.cache_key
        if key is not None and (not isinstance(key, str) or len(key) > 1024):
            raise ValueError(f"cache_key must be a string of at most 1024 characters, got {key!r:.80}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {so!r}")
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, Mapping):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")  # noqa: TRY004
        check_logit_bias_size(bias)
        pairs = []
        for tok, b in bias.items():
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {tok!r}")
            if not _is_number(b) or not math.isfinite(b):
                raise ValueError(f"logit_bias values must be finite numbers, got {b!r} for token {tok}")
            pairs.append((tok, max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(b)))))
        object.__setattr__(self, "_bias", tuple(pairs))

    @property
    def greedy(self) -> bool:
        """Whether sampling is argmax (temperature 0)."""
        return self.temperature < 1e-5

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (possibly empty)."""
        return self._stop

    @property
    def stop_regexes(self) -> tuple[StopRegex, ...]:
        """``stop_regex`` compiled (possibly empty)."""
        return self._stop_regex

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """``stop_token_ids`` as a tuple (possibly empty)."""
        return self._stop_ids

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token_id, clamped bias)`` pairs (possibly empty)."""
        return self._bias

    @property
    def logprob_ids(self) -> tuple[int, ...]:
        """``logprob_token_ids`` as a tuple (possibly empty)."""
        return tuple(self.logprob_token_ids or ())

    @property
    def allowed(self) -> tuple[int, ...]:
        """``allowed_token_ids`` as a tuple (empty: every id allowed)."""
        return tuple(self.allowed_token_ids or ())

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three repetition penalties is active."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n``: same settings, ``seed + index`` if seeded."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=self.seed + index)
