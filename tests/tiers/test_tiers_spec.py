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
