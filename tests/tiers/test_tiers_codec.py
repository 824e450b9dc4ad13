from __future__ import annotations

from collections.abc import Callable

import pytest

from prefixkv.tiers.codec import (
    TAG_BYTES,
    CorruptBlockError,
    RecordCheck,
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


def _streamed(rec: bytes, secret: bytes | None) -> None:
    """``rec`` through :class:`RecordCheck` as the remote tier reads it: header, pieces, tag."""
    head, tag = header_size("float32:2x1"), TAG_BYTES if secret else 0
    check = RecordCheck(KEY, "float32:2x1", 8, secret)
    check.head(rec[:head])
    check.update(rec[head:head + 3])
    check.update(rec[head + 3:len(rec) - tag])
    check.finish(rec[len(rec) - tag:] if secret else b"")


def _verdict(read: Callable[[], object]) -> type | None:
    try:
        read()
    except CorruptBlockError as exc:
        return type(exc)
    return None


@pytest.mark.parametrize("writer", [None, b"w", b"r"])
@pytest.mark.parametrize("reader", [None, b"r"])
def test_a_record_read_in_pieces_gets_decodes_verdict(writer: bytes | None,
                                                      reader: bytes | None) -> None:
    """Every byte altered, every cut: RecordCheck's verdict is decode's (ok, corrupt or
    unauthenticated), except where it must differ: under a secret, a MAC record cut short or
    with a forged key, layout or length field is corrupt to RecordCheck, which sees it before
    the MAC, and unauthenticated to decode (the MAC first); so is a header cut inside its layout
    (RecordCheck takes whole headers: StreamedRead fails a short piece before asking it)."""
    rec = encode(KEY, "float32:2x1", b"12345678", writer)
    head = header_size("float32:2x1")
    fields = {*range(6, 16), *range(24, head)}  # lengths, key, layout
    bad = [(rec[:n], n >= 56 and (writer is not None or n < head))  # 56: the fixed fields
           for n in range(len(rec))]
    for i in range(len(rec)):
        flipped = bytearray(rec)
        flipped[i] ^= 0x41
        bad.append((bytes(flipped), i in fields and writer is not None))
    assert _verdict(lambda: decode(rec, KEY, "float32:2x1", 8, reader)) is _verdict(
        lambda: _streamed(rec, reader)) is (None if writer == reader else (
            CorruptBlockError if reader is None else UnauthenticatedBlockError))
    for record, forged in bad:
        whole = _verdict(lambda: decode(record, KEY, "float32:2x1", 8, reader))
        assert whole is not None
        if forged and reader is not None:
            assert (whole, _verdict(lambda: _streamed(record, reader))) == (
                UnauthenticatedBlockError, CorruptBlockError)
        else:
            assert _verdict(lambda: _streamed(record, reader)) is whole, record


def test_is_record_of_reads_only_the_header() -> None:
    rec = encode(KEY, "float32:2x1", b"12345678", b"secret")
    head = rec[: header_size("float32:2x1")]
    assert is_record_of(head, KEY, "float32:2x1", authenticated=True)
    assert not is_record_of(head, KEY, "float32:2x1", authenticated=False)
    assert not is_record_of(head, bytes(32), "float32:2x1", authenticated=True)
    assert not is_record_of(head, KEY, "float16:2x1", authenticated=True)
    assert not is_record_of(b"PKVB", KEY, "float32:2x1", authenticated=True)
