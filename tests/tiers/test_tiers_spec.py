from __future__ import annotations

import pytest

from prefixkv.tiers import TierSpec, parse_size


@pytest.mark.parametrize("value,blocks", [
    (None, 0), (0, 0), (12, 12), ("1KiB", 16), ("2GiB", 2**31 // 64),
    ("1.5 MB", 1_500_000 // 64), ("64b", 1),
    # issue 40: a bare number is GiB (vLLM, SGLang, LMCache); blocks need the suffix
    ("12", 12 * 2**30 // 64), ("0.5", 2**29 // 64), ("0", 0),
    ("12blocks", 12), ("1 block", 1), ("64 Blocks", 64),
])
def test_parse_size(value: object, blocks: int) -> None:
    assert parse_size(value, 64, "x") == blocks  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["lots", "1.5blocks", "-3", -3, True, 2.0, "3 parsecs",
                                   "blocks", "12 blocks please"])
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


def test_a_bare_flag_value_is_gib_and_blocks_need_the_suffix(make_llm) -> None:  # type: ignore[no-untyped-def]
    """``--kv-offload-size 1`` meant one block (vLLM, SGLang and LMCache mean 1 GiB)."""
    from prefixkv.cli import build_parser
    from prefixkv.cli.flags import engine_kwargs

    def host_blocks(flag: str) -> tuple[int, int]:
        kw = engine_kwargs(build_parser().parse_args(["serve", "--kv-offload-size", flag]))
        kv = make_llm(num_kv_blocks=32, kv_offload_size=kw["kv_offload_size"]).engine.kv
        return kv.tiers.host.capacity, kv.tiers.transfer.block_nbytes

    blocks, nbytes = host_blocks("0.004")
    assert blocks == int(0.004 * 2**30) // nbytes > 1
    assert host_blocks("8blocks")[0] == 8


def test_a_host_tier_larger_than_the_machine_says_how_to_write_blocks() -> None:
    """A block count written the old way (``--kv-offload-size 100000``) is now 100,000 GiB: a
    clear error before anything is allocated, not an allocator failure (or an arena the machine
    cannot hold)."""
    with pytest.raises(ValueError, match=r"kv_offload_size '100000' is 100,000.0 GiB, more than "
                                         r"this machine's .* '100000blocks'"):
        TierSpec(offload_size="100000")
    assert TierSpec(offload_size="100000blocks").enabled
    assert TierSpec(offload_size=100000).enabled  # an int is a block count
