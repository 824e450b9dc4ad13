"""Process-local identities of a radix entry's blocks, for policies that remember blocks.

A block's identity is a chained hash of its tokens (``hash((parent identity, block tokens))``
from a policy's own root value), so the same prefix has the same identities wherever it is
cached, and after it was evicted. Policies memoize them per node; :func:`fold_identities`
folds from the deepest memoized ancestor, iteratively (paths can be long).

Identities are the same in every process: the root comes from :func:`identity_root` (not
``hash()`` of a string, which changes with ``PYTHONHASHSEED``) and the hash of a tuple of
ints is fixed, so a replay samples the same blocks and gives the same figures every run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from prefixkv.cache.radix_node import key_tokens

_HASHED_TYPES: dict[type, bool] = {}
"""entry type -> whether it is a hashed block (the answer is a property of the type)."""


def is_hashed_block(entry: Any) -> bool:
    """Whether ``entry`` is a hashed block (its chained ``hash`` is its identity), by type:
    one dict lookup per call, the attribute check once per entry type."""
    kind = type(entry)
    got = _HASHED_TYPES.get(kind)
    if got is None:
        got = _HASHED_TYPES[kind] = hasattr(entry, "hash")
    return got


def identity_root(label: str) -> int:
    """A policy's root identity: a fixed 63-bit int derived from ``label``, equal in every
    process (block identities, and so the blocks a sampling policy simulates, are then
    reproducible)."""
    digest = hashlib.blake2b(label.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def fold_identities(
    entry: Any,
    root: int,
    memoized: Callable[[Any], Sequence[int] | None],
    remember: Callable[[Any, list[int]], None],
) -> Sequence[int]:
    """Identities of ``entry``'s blocks, shallowest first.

    ``memoized(node)`` returns a node's identities if the policy has them (any sequence: a
    policy may keep them in an ``array('q')``, as hashes fit 64 signed bits); ``remember(node,
    identities)`` is called for every node folded here (each ancestor up to the memoized one).
    """
    if not entry.num_blocks:
        return []
    chain = []
    base: int | None = None
    node = entry
    while node is not None and not node.is_root:
        got = memoized(node)
        if got is not None:
            if node is entry:
                return got
            base = got[-1]
            break
        chain.append(node)
        node = node.parent
    h = root if base is None else base
    out: Sequence[int] = []
    for node in reversed(chain):
        key, n = key_tokens(node.key), node.num_blocks
        bs = len(key) // n
        fresh: list[int] = []
        for j in range(n):
            h = hash((h, tuple(key[j * bs:(j + 1) * bs])))
            fresh.append(h)
        remember(node, fresh)
        out = fresh
    return out
