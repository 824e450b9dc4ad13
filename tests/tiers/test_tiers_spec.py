from __future__ import annotations

import pytest

from prefixkv.tiers import TierSpec, parse_size


@pytest.mark.parametrize("value,blocks", [
    (None, 0), (0, 0), (12, 12), ("12", 12), ("1KiB", 16), ("2GiB", 2**31 // 64),
    ("1.5 MB", 1_500_000 // 64), ("64b", 1),
])
def test_parse_size(value: object, blocks: int) -> None:
    assert parse_size(value, 64, "x") == blocks  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["lots", "1.5", "-3", -3, True, 2.0, "3 parsecs"])
def test_parse_size_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="kv_thing"):
        parse_size(value, 64, "kv_thing")  # type: ignore[arg-type]


def test_spec_validation() -> None:
    assert not TierSpec().enabled
    assert TierSpec(offload_size="1GiB").enabled and TierSpec(disk_dir="/tmp/x").enabled
    assert TierSpec(remote="valkey://h:1").enabled
    with pytest.raises(ValueError, match="kv_remote"):
        TierSpec(remote="tcp://h:1")
    with pytest.raises(ValueError, match="kv_remote_timeout"):
        TierSpec(remote="redis://h:1", remote_timeout=0)
    with pytest.raises(ValueError, match="kv_offload_size"):
        TierSpec(offload_size="big")


def test_remote_urls_with_credentials_and_tls_and_the_secret() -> None:
    """(rediss:// and unix:// were refused; the message echoed the URL, password included.)"""
    for url in ("rediss://u:p@h:6380/0", "valkeys://h:6380", "unix:///run/valkey.sock",
                "redis://:p@h:6379/1"):
        assert TierSpec(remote=url).enabled
    with pytest.raises(ValueError, match="kv_remote must be a URL starting redis://") as err:
        TierSpec(remote="http://u:hunter2@h:1")
    assert "hunter2" not in str(err.value)
    spec = TierSpec(remote="redis://h:1", remote_secret="s3cret")
    assert "s3cret" not in repr(spec)
    for bad in ("", 12):
        with pytest.raises(ValueError, match="kv_remote_secret"):
            TierSpec(remote="redis://h:1", remote_secret=bad)  # type: ignore[arg-type]


def test_the_secret_flag_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from prefixkv.config import EngineConfig
    from prefixkv.cli.flags import add_engine_flags, engine_kwargs

    def parse(*argv: str) -> EngineConfig:
        p = argparse.ArgumentParser()
        add_engine_flags(p)
        return EngineConfig.from_kwargs(**engine_kwargs(p.parse_args(["m", *argv])))

    monkeypatch.delenv("PREFIXKV_KV_REMOTE_SECRET", raising=False)
    assert parse("--kv-remote", "redis://h:1").tiers.remote_secret is None
    monkeypatch.setenv("PREFIXKV_KV_REMOTE_SECRET", "from-env")
    assert parse("--kv-remote", "redis://h:1").tiers.remote_secret == "from-env"
    assert parse("--kv-remote-secret", "flag").tiers.remote_secret == "flag"
