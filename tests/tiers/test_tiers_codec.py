from __future__ import annotations

import pytest

from prefixkv.tiers.codec import (
    CorruptBlockError,
    UnauthenticatedBlockError,
    decode,
    encode,
    header_size,
    is_record_of,
    secret_id,
)

KEY = bytes(range(32))


def test_roundtrip() -> None:
    rec = encode(KEY, "float32:2x1", b"12345678")
    out = decode(rec, KEY, "float32:2x1", 8)
    assert out == b"12345678" and type(out) is bytes


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


def test_mac_roundtrip_and_rejections() -> None:
    rec = encode(KEY, "float32:2x1", b"12345678", b"secret")
    assert decode(rec, KEY, "float32:2x1", 8, b"secret") == b"12345678"
    with pytest.raises(UnauthenticatedBlockError, match="MAC mismatch"):
        decode(rec, KEY, "float32:2x1", 8, b"other")
    for cut in (rec[:-1], rec[:40], rec[:-32]):
        with pytest.raises(CorruptBlockError):
            decode(cut, KEY, "float32:2x1", 8, b"secret")
    with pytest.raises(UnauthenticatedBlockError, match="no MAC"):
        decode(encode(KEY, "float32:2x1", b"12345678"), KEY, "float32:2x1", 8, b"secret")
    with pytest.raises(CorruptBlockError, match="no secret"):
        decode(rec, KEY, "float32:2x1", 8)
    assert secret_id(b"secret") != secret_id(b"other") and len(secret_id(b"secret")) == 16


def test_is_record_of_reads_only_the_header() -> None:
    rec = encode(KEY, "float32:2x1", b"12345678", b"secret")
    head = rec[: header_size("float32:2x1")]
    assert is_record_of(head, KEY, "float32:2x1", authenticated=True)
    assert not is_record_of(head, KEY, "float32:2x1", authenticated=False)
    assert not is_record_of(head, bytes(32), "float32:2x1", authenticated=True)
    assert not is_record_of(head, KEY, "float16:2x1", authenticated=True)
    assert not is_record_of(b"PKVB", KEY, "float32:2x1", authenticated=True)
