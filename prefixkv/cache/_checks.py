"""Argument checks shared by the indexes: fail early, name the argument, change nothing."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from prefixkv.cache._native import keypack as _keypack  # None: the Python path


def as_token_list(token_ids: Any, name: str = "token_ids") -> Sequence[int]:
    """Return ``token_ids`` as a list of ints, or an ``array`` as is (numpy arrays, tensors,
    tuples and ranges become lists, in C where they expose ``tolist``/``numpy``).

    Only the container is checked here; values are checked by :func:`check_tokens` where they
    are new to the index (values equal to cached keys are valid by construction).
    """
    if isinstance(token_ids, (list, array)):
        return token_ids
    if isinstance(token_ids, tuple):
        return list(token_ids)
    _reject_non_sequence(token_ids, name)
    if isinstance(token_ids, np.ndarray) or callable(getattr(token_ids, "numpy", None)):
        return as_token_array(token_ids, name).tolist()
    tolist = getattr(token_ids, "tolist", None)
    if callable(tolist):
        out = tolist()
        if isinstance(out, list):
            return out
    try:
        return list(token_ids)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}") from None


def as_token_array(token_ids: Any, name: str = "token_ids", narrow: bool = False) -> array[int]:
    """Return ``token_ids`` as an ``array('I')`` (the radix tree's key type), every value checked.

    With ``narrow=True``: as an ``array('H')`` (2 bytes a token) when every value is below
    2**16 (a vocabulary of at most 65,536 tokens), else as an ``array('I')`` all the same.

    No per-element Python work for any supported input: an ``array('I')`` is returned as is (the
    fastest form), a list, tuple or range is packed in C by ``array``, and other int arrays
    (``array('q')`` and the other int typecodes, numpy arrays, CPU torch tensors, found by
    duck typing through ``.numpy()`` so this module imports no torch) go through numpy's
    buffer protocol: one bounds check and one cast. ``ValueError`` names the argument for a
    non-int element or dtype, a negative or too large (>= 2**32) value, a tensor that is not
    on the CPU, or an array that is not 1-D.
    """
    kind = type(token_ids)
    if kind is array:
        code = token_ids.typecode
        if code == "I" and not narrow or code == "H" and narrow:
            return token_ids  # type: ignore[no-any-return]
        if code == "I" and token_ids:
            return _narrowed(token_ids)
        if code not in _INT_TYPECODES:
            raise ValueError(f"{name} must contain ints, got array({code!r})")
        if token_ids.itemsize == 8 and token_ids:  # array('q'), SGLang's key type
            packed = _from_words(token_ids, narrow)
            if packed is not None:
                return packed
        return _from_numpy(np.frombuffer(token_ids, dtype=np.dtype(code)), name, narrow)
    if kind is list or kind is tuple or kind is range:
        if _keypack is not None and kind is not range:  # one C pass, 2-6x array("I", ...)
            words = _keypack.from_list(token_ids, narrow)
            if words is not None:  # (None: a non-int or out-of-range item, reported below)
                return _from_helper(words, len(token_ids))
        try:  # array("H", ...) parses each item with a format string: twice as slow as "I"
            packed = array("I", token_ids)
        except (TypeError, OverflowError):
            check_tokens(list(token_ids), name)  # raises the precise ValueError
            raise
        return _narrowed(packed) if narrow and packed else packed
    _reject_non_sequence(token_ids, name)
    if isinstance(token_ids, np.ndarray):
        return _from_numpy(token_ids, name, narrow)
    to_numpy = getattr(token_ids, "numpy", None)
    if callable(to_numpy):  # a torch tensor
        try:
            as_np = to_numpy()
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"{name}: a tensor must be a CPU tensor without grad ({exc})") from None
        return _from_numpy(np.asarray(as_np), name, narrow)
    try:
        seq = list(token_ids)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {kind.__name__}") from None
    return as_token_array(seq, name, narrow)


_INT_TYPECODES = frozenset("bBhHiIlLqQ")


def _reject_non_sequence(token_ids: Any, name: str) -> None:
    if isinstance(token_ids, (str, bytes, bytearray)) or token_ids is None:
        raise ValueError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")


def _from_numpy(x: np.ndarray[Any, Any], name: str, narrow: bool = False) -> array[int]:
    """A 1-D numpy int array as a checked ``array('I')``: one check pass, one cast, one copy.

    Contiguous 64-bit ints (numpy/torch int64) take :func:`_from_words` (one maximum, one
    cast). ``narrow``: an ``array('H')`` when every value is below 2**16.
    """
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    kind = x.dtype.kind
    if kind not in "iu":
        raise ValueError(f"{name} must contain ints, got dtype {x.dtype}")
    if x.dtype.itemsize == 8 and x.dtype.isnative and x.flags.c_contiguous and x.size:
        packed = _from_words(x, narrow)  # int64 / uint64: numpy's and torch's default
        if packed is not None:
            return packed
        _check_range(x, name)  # raises: a value is out of range
    if narrow and x.size:
        lo = int(x.min()) if kind == "i" else 0
        hi = int(x.max())
        if lo < 0:
            raise ValueError(f"{name} must be non-negative, found {lo}")
        if hi <= 0xFFFF:
            out = array("H")
            out.frombytes(np.ascontiguousarray(x.astype(np.uint16)).data.cast("B"))
            return out
        if hi > MAX_TOKEN_ID:
            raise ValueError(f"{name} must be < 2**32, found {hi}")
        x = x.astype(np.uint32)
    if x.dtype != np.uint32 and x.size:
        if kind == "i" or x.dtype.itemsize > 4:
            _check_range(x, name)
        x = x.astype(np.uint32)
    out = array("I")
    out.frombytes(np.ascontiguousarray(x).data.cast("B"))  # one copy, any strides
    return out


def _narrowed(packed: array[int]) -> array[int]:
    """A non-empty ``array('I')`` as ``array('H')`` if every value fits, else itself."""
    words = np.frombuffer(packed, dtype=_U32)
    if words[words.argmax()] > 0xFFFF:
        return packed
    out = array("H")
    out.frombytes(words.astype(np.uint16).tobytes())
    return out


def _from_words(ints64: Any, narrow: bool) -> array[int] | None:
    """A native, contiguous 64-bit int buffer (an ``array('q')``, a numpy int64 array) read
    as uint64: a negative value reads as >= 2**63, so one
    maximum checks every value against ``[0, 2**32)`` (and against 2**16 for ``narrow``), and
    one truncating cast packs them. ``None`` when a value is out of range (the caller reports
    it). About 2 us for 2,048 ids in numpy, half of it per-call overhead; about 1 us in one pass
    of the C helper when it is built."""
    if _keypack is not None:  # one C pass, about 2x faster for a query's length
        words = _keypack.narrow64(ints64, narrow)
        return None if words is None else _from_helper(words, len(ints64))
    x = np.frombuffer(ints64, dtype=_U64)
    hi = x[x.argmax()]  # argmax is a C method: 3x cheaper than max() for a query's length
    if hi > MAX_TOKEN_ID:
        return None
    if narrow and hi <= 0xFFFF:
        return array("H", x.astype(_U16).tobytes())
    return array("I", x.astype(_U32).tobytes())


def _from_helper(words: bytes, n: int) -> array[int]:
    """The C helper's ``n`` ids (``from_list`` / ``narrow64``: 2 bytes an id when it narrowed
    them, else 4) as the matching array."""
    out = array("H" if n and len(words) < 4 * n else "I")
    out.frombytes(words)
    return out


_U32 = np.dtype(np.uint32)
_U64 = np.dtype(np.uint64)
_U16 = np.dtype(np.uint16)


def _check_range(x: np.ndarray[Any, Any], name: str) -> None:
    """``ValueError`` naming the first bound ``x`` breaks (negative, or >= 2**32)."""
    if x.dtype.kind == "i":
        lo = int(x.min())
        if lo < 0:
            raise ValueError(f"{name} must be non-negative, found {lo}")
    if x.dtype.itemsize > 4:
        hi = int(x.max())
        if hi > MAX_TOKEN_ID:
            raise ValueError(f"{name} must be < 2**32, found {hi}")



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


def exact_ids_below(ids: list[Any], limit: int) -> bool | None:
    """Whether every item of the list ``ids`` is exactly an ``int`` (no ``bool``, no subclass)
    in ``[0, limit)``: one C pass and one numpy maximum (a 2,080-id prompt: about 6 us, where
    ``set(map(type, ids))``, ``min`` and ``max`` take 60). ``None`` without the C helper: the
    caller checks in Python. The engine's prompt check (``prefixkv/engine/prompts.py``)."""
    if _keypack is None:
        return None
    words = _keypack.from_list(ids, False, True)
    if words is None:
        return False
    return not ids or int(np.frombuffer(words, dtype=np.uint32).max()) < limit


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
