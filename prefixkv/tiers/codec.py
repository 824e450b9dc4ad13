"""The stored form of one KV block: a small header, then the raw bytes.

Header (little endian): magic ``PKVB``, version (u16), header length (u16), payload length
(u64), xxhash64 of the payload (u64), the block key (32 bytes), then the layout string (utf-8,
e.g. ``float32:2x4x16x2x64``). :func:`decode` accepts a record only when every field matches
what the reader expects and the checksum holds; anything else is :class:`CorruptBlockError`,
which callers treat as a miss (and delete), never as KV.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"PKVB"
VERSION = 1
_FIXED = struct.Struct("<4sHHQQ32s")


class CorruptBlockError(ValueError):
    """A stored block is truncated, damaged, or for another key/layout."""


def encode(key: bytes, layout: str, payload: bytes) -> bytes:
    """The stored record of ``payload`` (one block's KV bytes) under ``key``."""
    lay = layout.encode()
    head = _FIXED.pack(MAGIC, VERSION, _FIXED.size + len(lay), len(payload),
                       xxhash.xxh64_intdigest(payload), key)
    return head + lay + payload


def decode(record: bytes, key: bytes, layout: str, nbytes: int) -> bytes:
    """The payload of ``record`` if it is intact and holds ``key`` in ``layout`` with
    ``nbytes`` bytes; else :class:`CorruptBlockError` saying what is wrong."""
    if len(record) < _FIXED.size:
        raise CorruptBlockError(f"truncated header ({len(record)} bytes)")
    magic, version, head_len, length, checksum, stored_key = _FIXED.unpack_from(record)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlockError(f"bad magic/version {magic!r}/{version}")
    if stored_key != key:
        raise CorruptBlockError("record holds another key")
    lay = layout.encode()
    if head_len != _FIXED.size + len(lay) or record[_FIXED.size : head_len] != lay:
        raise CorruptBlockError("layout differs")
    if length != nbytes or len(record) != head_len + length:
        raise CorruptBlockError(f"payload is {len(record) - head_len} bytes, expected {nbytes}")
    payload = record[head_len:]
    if xxhash.xxh64_intdigest(payload) != checksum:
        raise CorruptBlockError("checksum mismatch")
    return payload
