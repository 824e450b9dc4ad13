"""Argument checks shared by the indexes: fail early, name the argument, change nothing."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any


def as_token_list(token_ids: Any, name: str = "token_ids") -> Sequence[int]:
    """Return ``token_ids`` as a list of ints, or an ``array`` as is (numpy arrays, tuples and
    ranges become lists).

    Only the container is checked here; values are checked by :func:`check_tokens` where they
    are new to the index (values equal to cached keys are valid by construction).
    """
    if isinstance(token_ids, (list, array)):
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


MAX_TOKEN_ID = 2**32 - 1
"""Token ids are stored as uint32 (4 bytes a token in the radix tree)."""


def check_tokens(tokens: Sequence[int], name: str = "token_ids") -> None:
    """``ValueError`` unless every element is an int in ``[0, 2**32)``.

    One C-speed pass: the values are packed into an ``array('I')``, which rejects non-ints,
    negatives and ids too large for the uint32 keys of the radix tree.
    """
    if not tokens or (type(tokens) is array and tokens.typecode == "I"):
        return
    try:
        array("I", tokens)
    except (TypeError, OverflowError):
        for t in tokens:
            if type(t) is not int and not hasattr(t, "__index__"):
                raise ValueError(f"{name} must contain ints, found {t!r} ({type(t).__name__})")
            if int(t) < 0:
                raise ValueError(f"{name} must be non-negative, found {t}")
            if int(t) > MAX_TOKEN_ID:
                raise ValueError(f"{name} must be < 2**32, found {t}")
        raise ValueError(f"{name} must contain ints in [0, 2**32)") from None


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
