"""SamplingParams: how one request is sampled and when it stops (vLLM's names and defaults).

Validated once at construction: a bad value raises ``ValueError`` naming the field. The
object is frozen; ``stop`` and ``stop_token_ids`` are normalised to tuples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

_MIN_SEED = -(2**63)  # the range torch.Generator.manual_seed accepts
_MAX_SEED = 2**64 - 1


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
        stop_token_ids: token ids that end generation (the id stays in ``token_ids``).
        ignore_eos: keep generating past the EOS token.
        skip_special_tokens: leave special tokens out of the decoded text.
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
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _stop_ids: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

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
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must hold non-empty strings, got {stop!r}")
        ids = self.stop_token_ids
        if ids is None:
            stop_ids: tuple[int, ...] = ()
        elif isinstance(ids, Sequence) and not isinstance(ids, str):
            stop_ids = tuple(ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of ints or None, got {ids!r}")
        if not all(_is_int(t) and t >= 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must hold ints >= 0, got {ids!r}")
        object.__setattr__(self, "_stop", stops)
        object.__setattr__(self, "_stop_ids", stop_ids)

    @property
    def greedy(self) -> bool:
        """Whether sampling is argmax (temperature 0)."""
        return self.temperature < 1e-5

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (possibly empty)."""
        return self._stop

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """``stop_token_ids`` as a tuple (possibly empty)."""
        return self._stop_ids

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n``: same settings, ``seed + index`` if seeded."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=self.seed + index)
