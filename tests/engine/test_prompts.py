"""Prompt ids: plain ints in the vocabulary pass as they are, anything else is a clear error.

Mirrors ``prefixkv/engine/prompts.py`` (``resolve_prompt``'s id check; text prompts and the
chat template are covered through the engine in ``test_llm.py`` / ``test_failures.py``).
"""

from __future__ import annotations

import enum

import numpy as np
import pytest

from prefixkv.cache import _checks
from prefixkv.engine.prompts import resolve_prompt

VOCAB = 259


class Tok(enum.IntEnum):
    A = 7


def _resolve(ids):
    try:
        text, out = resolve_prompt(None, VOCAB, ids)
    except ValueError as exc:
        return str(exc)
    assert text is None and all(type(t) is int for t in out)
    return out


GOOD = [([1, 2, 258], [1, 2, 258]), ((5, 6), [5, 6]), (range(3), [0, 1, 2]),
        ([Tok.A, 1], [7, 1]), ([np.int64(3), np.uint16(4)], [3, 4]),
        ({"prompt_token_ids": [4, 5]}, [4, 5]),  # IntEnum members and numpy ints: plain ints
        ({"prompt_token_ids": [4, 5, 6], "truncate_prompt_tokens": 2}, [5, 6]),  # the last k kept
        ({"prompt_token_ids": [4, 5, 6], "truncate_prompt_tokens": 2, "truncation_side": "right"}, [4, 5]),
        ({"prompt_token_ids": [4], "truncate_prompt_tokens": 2}, [4])]
BAD = [([True, 1], "id True is a bool"), ([np.True_], "is a bool"), ([1, -1], "id -1 out of range"),
       ([259], "id 259 out of range"), ([2**32], f"id {2**32} out of range"),
       ([2**70], f"id {2**70} out of range"), ([np.int64(300)], "id 300 out of range"),
       ([1.0], "id 1.0 is not an int"), (["a"], "id 'a' is not an int"), ([], "empty"),
       (None, "must be a str"),
       ({"prompt_token_ids": [1], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be"),
       ({"prompt_token_ids": [1], "truncate_prompt_tokens": True}, "truncate_prompt_tokens must be"),
       ({"prompt_token_ids": [1], "truncation_side": "middle"}, "truncation_side must be"),
       ({"prompt_token_ids": [1], "add_special_tokens": "no"}, "add_special_tokens must be a bool")]


@pytest.mark.parametrize("with_c", [True, False])
def test_ids_are_checked_the_same_with_and_without_the_c_helper(monkeypatch, with_c):
    if not with_c:
        monkeypatch.setattr(_checks, "_keypack", None)
    for ids, expected in GOOD:
        assert _resolve(ids) == expected
    for ids, expected in BAD:
        assert expected in _resolve(ids), ids


def test_a_bad_id_is_named_even_at_the_end_of_a_long_prompt():
    ids = list(range(200)) * 20 + [VOCAB]
    with pytest.raises(ValueError, match=f"prompt token id {VOCAB} out of range"):
        resolve_prompt(None, VOCAB, ids)
    assert resolve_prompt(None, VOCAB, ids[:-1])[1] == ids[:-1]
