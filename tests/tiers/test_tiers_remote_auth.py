"""Authenticated records and server credentials for the shared tier, against a real
valkey-server: a writer that recomputes the xxhash64 after changing the KV is caught by the MAC
(a miss, counted, deleted) and the greedy output equals a cold run; another secret reads
nothing; Valkey AUTH through the URL works and a missing password fails cleanly."""

from __future__ import annotations

import hashlib
import logging
import struct
from typing import Any

import pytest
import xxhash

from prefixkv.engine import SamplingParams
from prefixkv.tiers.codec import encode
from prefixkv.tiers.remote import PREFIX, RemoteTier, redact

LAYOUT = "uint8:16"
SECRET = b"fleet secret: 32 random bytes in production"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def tamper(record: bytes) -> bytes:
    """``record`` with other KV and a recomputed xxhash64: what a client that can write to the
    server does (header: magic, version, header length, payload length, xxhash64, key)."""
    head_len, length = struct.unpack_from("<HQ", record, 6)
    end = head_len + length
    forged = bytes(b ^ 0x5A for b in record[head_len:end])
    return (record[:16] + struct.pack("<Q", xxhash.xxh64_intdigest(forged))
            + record[24:head_len] + forged + record[end:])


def tamper_all(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    names = [n for n in client.scan_iter(match=PREFIX + b"*") if not n.startswith(b"pkv:pin:")]
    for name in names:
        client.set(name, tamper(client.get(name)))
    client.close()
    return len(names)


def test_a_record_with_a_recomputed_checksum_is_caught_by_the_mac(valkey: Any) -> None:
    """(Was accepted: the xxhash64 is no defence against a writer.)"""
    import redis

    plain = RemoteTier(valkey.url, LAYOUT, 16, timeout=5.0)
    signed = RemoteTier(valkey.url, LAYOUT, 16, timeout=5.0, secret=SECRET)
    plain.submit(key(0), b"a" * 16)
    signed.submit(key(1), b"b" * 16)
    assert plain.flush() and signed.flush()
    assert tamper_all(valkey.url) == 2
    assert plain.read_many([key(0)]) == [bytes(b ^ 0x5A for b in b"a" * 16)]  # the checksum holds
    assert signed.read_many([key(1)]) == [None]
    assert signed.counters.get("unauthenticated") == 1 and signed.counters.get("corrupt") == 0
    client = redis.Redis.from_url(valkey.url)
    assert client.get(PREFIX + key(1)) is None  # deleted: the next publish writes it again
    signed.submit(key(1), b"b" * 16)
    assert signed.flush() and signed.read_many([key(1)]) == [b"b" * 16]
    plain.close()
    signed.close()


def test_another_secret_or_none_reads_nothing(valkey: Any) -> None:
    import redis

    ours = RemoteTier(valkey.url, LAYOUT, 16, timeout=5.0, secret=SECRET)
    ours.submit(key(0), b"a" * 16)
    assert ours.flush()
    other = RemoteTier(valkey.url, LAYOUT, 16, timeout=5.0, secret=b"another secret")
    assert other.read_many([key(0)]) == [None] and other.counters.get("unauthenticated") == 1
    redis.Redis.from_url(valkey.url).set(PREFIX + key(2), encode(key(2), LAYOUT, b"c" * 16))
    assert ours.read_many([key(2)]) == [None]  # no MAC at all
    assert ours.counters.get("unauthenticated") == 1
    plain = RemoteTier(valkey.url, LAYOUT, 16, timeout=5.0)
    ours.submit(key(3), b"d" * 16)
    assert ours.flush()
    assert plain.read_many([key(3)]) == [None] and plain.counters.get("corrupt") == 1
    for r in (ours, other, plain):
        r.close()


def test_tampered_kv_never_changes_another_workers_output(
    valkey: Any, make_llm: Any, tokens: Any
) -> None:
    """Worker A publishes, a writer rewrites every block (checksums recomputed), worker B (same
    secret) recomputes: its greedy output equals a cold run; a worker with another secret never
    even sees A's records (other keys)."""
    prompts = [tokens(40, 64) + tokens(41 + i, 9) for i in range(3)]
    cold = make_llm(enable_prefix_caching=False).generate(prompts, GREEDY)
    want = [o.outputs[0].token_ids for o in cold]
    a = make_llm(kv_remote=valkey.url, kv_remote_timeout=5.0, kv_remote_secret=SECRET.decode())
    assert [o.outputs[0].token_ids for o in a.generate(prompts, GREEDY)] == want
    assert a.engine.kv.tiers.flush()
    assert tamper_all(valkey.url) > 0
    b = make_llm(kv_remote=valkey.url, kv_remote_timeout=5.0, kv_remote_secret=SECRET.decode())
    outs = b.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    remote = next(t for t in b.get_stats().tiers if t.tier == "remote")
    assert remote.hits == 0 and remote.unauthenticated > 0
    c = make_llm(kv_remote=valkey.url, kv_remote_timeout=5.0, kv_remote_secret="another secret")
    assert [o.outputs[0].token_ids for o in c.generate(prompts, GREEDY)] == want
    remote = next(t for t in c.get_stats().tiers if t.tier == "remote")
    assert remote.hits == 0 and remote.unauthenticated == 0  # other keys: plain misses


def test_untampered_records_are_hits_with_the_secret(
    valkey: Any, make_llm: Any, tokens: Any
) -> None:
    prompts = [tokens(50, 64) + tokens(51, 9)]
    a = make_llm(kv_remote=valkey.url, kv_remote_timeout=5.0, kv_remote_secret="s3cret")
    want = [o.outputs[0].token_ids for o in a.generate(prompts, GREEDY)]
    assert a.engine.kv.tiers.flush()
    b = make_llm(kv_remote=valkey.url, kv_remote_timeout=5.0, kv_remote_secret="s3cret")
    outs = b.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want and outs[0].num_cached_tokens >= 64
    remote = next(t for t in b.get_stats().tiers if t.tier == "remote")
    assert remote.hits > 0 and remote.unauthenticated == 0


def test_auth_url_works_and_a_missing_password_fails_cleanly(
    valkey_auth: Any, caplog: pytest.LogCaptureFixture
) -> None:
    host = valkey_auth.url.removeprefix("redis://")
    good = RemoteTier(f"redis://:pa55word@{host}", LAYOUT, 16, timeout=5.0, secret=SECRET)
    good.submit(key(0), b"a" * 16)
    assert good.flush() and good.read_many([key(0)]) == [b"a" * 16]
    assert good.counters.get("errors") == 0
    with caplog.at_level(logging.WARNING, logger="prefixkv.tiers.remote"):
        for url in (f"redis://{host}", f"redis://default:wrong@{host}"):
            bad = RemoteTier(url, LAYOUT, 16, timeout=0.5)  # no connection yet: no error
            assert bad.read_many([key(0)]) == [None] and not bad.is_up
            assert bad.counters.get("errors") == 1
            bad.close()
    assert len(caplog.records) == 2
    assert all("it wants a password" in r.getMessage() for r in caplog.records)
    assert "wrong" not in caplog.text and "pa55word" not in caplog.text  # never logged
    good.close()


def test_bad_url_message_hides_the_password() -> None:
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match="kv_remote") as err:
        RemoteTier("redis://u:hunter2@host:notaport", LAYOUT, 16)
    assert "hunter2" not in str(err.value)


@pytest.mark.parametrize("url,shown", [
    ("redis://u:p@h:1/0", "redis://u:***@h:1/0"),
    ("rediss://:p@[::1]:6380/2", "rediss://:***@[::1]:6380/2"),
    ("redis://h:6379", "redis://h:6379"),
    ("unix:///run/valkey.sock?db=1&password=p", "unix:///run/valkey.sock?db=1&password=***"),
])
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_tls_url_with_a_password(valkey_tls: Any, caplog: pytest.LogCaptureFixture) -> None:
    """``valkeys://`` (= ``rediss://``) with a password and a CA file (redis-py's
    ``ssl_ca_certs``): a real TLS connection (to a TLS front of the AUTH server); without the
    CA, or without TLS, a clean failure (counted, the engine would recompute)."""
    base = f":pa55word@127.0.0.1:{valkey_tls.port}/0"
    r = RemoteTier(f"valkeys://{base}?ssl_ca_certs={valkey_tls.ca}", LAYOUT, 16, timeout=5.0,
                   secret=SECRET)
    r.submit(key(0), b"a" * 16)
    assert r.flush() and r.read_many([key(0)]) == [b"a" * 16]
    assert r.counters.get("errors") == 0
    r.close()
    with caplog.at_level(logging.WARNING, logger="prefixkv.tiers.remote"):
        for url in (f"rediss://{base}", f"redis://{base}"):  # untrusted certificate; plain TCP
            bad = RemoteTier(url, LAYOUT, 16, timeout=1.0)
            assert bad.read_many([key(0)]) == [None] and bad.counters.get("errors") == 1
            bad.close()
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text and "pa55word" not in caplog.text
