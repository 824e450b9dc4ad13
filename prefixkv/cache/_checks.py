"""Argument checks shared by the indexes: fail early, name the argument, change nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def as_token_list(token_ids: Any, name: str = "token_ids") -> Sequence[int]:
    """Return ``token_ids`` as a list of ints (numpy arrays and ranges are converted).

    Only the container is checked here; values are checked by :func:`check_tokens` where they
    are new to the index (values equal to cached keys are valid by construction).
    """
    if isinstance(token_ids, list):
        return token_ids
    if isinstance(token_ids, tuple):
        return list(token_ids)
    if isinstance(token_ids, (str, bytes, bytearray)) or token_ids is None:
        raise ValueError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    tolist = getattr(token_ids, "tolist", None)
    if callable(tolist):
        out = tolist()
        if isinstance(out, list):
            return out
    try:
        return list(token_ids)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}") from None


def check_tokens(tokens: Sequence[int], name: str = "token_ids") -> None:
    """``ValueError`` unless every element is a non-negative int (bools are rejected)."""
    if not tokens:
        return
    if set(map(type, tokens)) != {int}:
        t = next(t for t in tokens if type(t) is not int)
        raise ValueError(f"{name} must contain ints, found {t!r} ({type(t).__name__})")
    if min(tokens) < 0:
        raise ValueError(f"{name} must be non-negative, found {min(tokens)}")


def check_block_ids(ids: Sequence[int], max_blocks: int, name: str = "kv_block_ids") -> None:
    """``ValueError`` unless the ids are distinct ints in ``[0, max_blocks)``."""
    if not ids:
        return
    if set(map(type, ids)) != {int}:
        b = next(b for b in ids if type(b) is not int)
        raise ValueError(f"{name} must contain ints, found {b!r} ({type(b).__name__})")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= max_blocks:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name}: block id {bad} out of range [0, {max_blocks})")
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        dup = next(b for b in ids if b in seen or seen.add(b))  # type: ignore[func-returns-value]
        raise ValueError(f"{name}: block id {dup} is repeated")


def check_positive_int(value: Any, name: str) -> int:
    """``ValueError`` unless ``value`` is an int > 0."""
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_count(value: Any, name: str) -> int:
    """``ValueError`` unless ``value`` is an int >= 0."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value
