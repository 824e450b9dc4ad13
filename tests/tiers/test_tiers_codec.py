from __future__ import annotations

import pytest

from prefixkv.tiers.codec import CorruptBlockError, decode, encode

KEY = bytes(range(32))


def test_roundtrip() -> None:
    rec = encode(KEY, "float32:2x1", b"12345678")
    assert decode(rec, KEY, "float32:2x1", 8) == b"12345678"


@pytest.mark.parametrize("damage,reason", [
    (lambda r: r[:10], "truncated header"),
    (lambda r: r[:-1], "payload is"),
    (lambda r: b"XXXX" + r[4:], "magic"),
    (lambda r: r[:-1] + bytes([r[-1] ^ 1]), "checksum"),
    (lambda r: r + b"x", "payload is"),
])
def test_damage_is_detected(damage: object, reason: str) -> None:
    rec = encode(KEY, "float32:2x1", b"12345678")
    with pytest.raises(CorruptBlockError, match=reason):
        decode(damage(rec), KEY, "float32:2x1", 8)  # type: ignore[operator]


def test_wrong_key_or_layout() -> None:
    rec = encode(KEY, "float32:2x1", b"12345678")
    with pytest.raises(CorruptBlockError, match="another key"):
        decode(rec, bytes(32), "float32:2x1", 8)
    with pytest.raises(CorruptBlockError, match="layout"):
        decode(rec, KEY, "bfloat16:4x1", 8)
