"""Chained block hashes: ``hash(parent_hash, block_tokens, extra_key)`` (vLLM's scheme).

Every chain starts from a fixed root seed mixed with the namespace, so hashes agree across
processes and machines for ``sha256`` and ``xxhash`` (the router or a second engine can compute
the same keys). ``builtin`` uses Python's ``hash`` on tuples: fastest, 64-bit, stable across
processes only for int/bytes-free keys with no ``str`` in them (``str`` hashing is salted per
process unless PYTHONHASHSEED is fixed).

Keys and extra keys are serialised canonically: ints as 8-byte little-endian, and extra keys /
namespaces through ``repr`` of ``None``, ``int``, ``str``, ``bytes`` or tuples of those (all
deterministic). Anything else is rejected with ``ValueError``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

HASH_ALGOS = ("sha256", "xxhash", "builtin")
ROOT_SEED = b"prefixkv/block-hash/v1"

BlockHasher = Callable[[Any, Sequence[int], Any], Any]


def check_key_part(value: Any, name: str) -> None:
    """``ValueError`` unless ``value`` serialises deterministically (None/int/str/bytes/tuples)."""
    if value is None or type(value) in (int, str, bytes, bool):
        return
    if type(value) is tuple:
        for v in value:
            check_key_part(v, name)
        return
    raise ValueError(
        f"{name} must be None, int, str, bytes or a tuple of those, got {type(value).__name__}"
    )


def _encode(parent: bytes, tokens: Sequence[int], extra: Any) -> bytes:
    data = parent + struct.pack(f"<{len(tokens)}q", *tokens)
    if extra is not None:
        data += b"\x00x" + repr(extra).encode()
    return data


def _sha256(parent: Any, tokens: Sequence[int], extra: Any) -> bytes:
    return hashlib.sha256(_encode(parent, tokens, extra)).digest()


def _xxhash(parent: Any, tokens: Sequence[int], extra: Any) -> bytes:
    return xxhash.xxh3_128_digest(_encode(parent, tokens, extra))


def _builtin(parent: Any, tokens: Sequence[int], extra: Any) -> int:
    # no None inside the hashed tuple: on CPython 3.11 hash(None) is its address, different in
    # every process, so even PYTHONHASHSEED could not make the hashes repeat (vLLM's promise)
    if extra is None:
        return hash((parent, tuple(tokens)))
    return hash((parent, tuple(tokens), repr(extra)))


def make_block_hasher(algo: str) -> BlockHasher:
    """The block-hash function for ``algo`` (``sha256``, ``xxhash`` or ``builtin``)."""
    if algo == "sha256":
        return _sha256
    if algo == "xxhash":
        return _xxhash
    if algo == "builtin":
        return _builtin
    raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {algo!r}")


def root_hash(algo: str, namespace: Any) -> Any:
    """The parent hash of a chain's first block in ``namespace``."""
    check_key_part(namespace, "namespace")
    if algo == "builtin":  # repr: a None namespace would hash by address (see _builtin)
        return hash((ROOT_SEED, repr(namespace)))
    seed = ROOT_SEED + b"\x00ns" + repr(namespace).encode()
    return hashlib.sha256(seed).digest() if algo == "sha256" else xxhash.xxh3_128_digest(seed)


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256",
    namespace: Any = None,
    extra_keys: Sequence[Any] | None = None,
) -> list[Any]:
    """Hashes of every full block of ``token_ids`` (what a router or a peer would compute)."""
    hasher = make_block_hasher(algo)
    parent = root_hash(algo, namespace)
    out = []
    for j in range(len(token_ids) // block_size):
        extra = extra_keys[j] if extra_keys is not None else None
        parent = hasher(parent, token_ids[j * block_size : (j + 1) * block_size], extra)
        out.append(parent)
    return out
