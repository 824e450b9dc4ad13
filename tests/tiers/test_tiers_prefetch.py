"""Prefetch: a queued request's disk / remote blocks are read into host staging in the
background, verified, and taken at admission; greedy outputs stay identical."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from prefixkv.engine import SamplingParams
from prefixkv.tiers.disk import DiskTier
from prefixkv.tiers.prefetch import Prefetcher
from prefixkv.tiers.remote import RemoteTier

LAYOUT = "uint8:16"
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_stages_the_leading_run_from_disk_then_remote(tmp_path: Path, valkey: Any) -> None:
    disk = DiskTier(tmp_path, 8, LAYOUT, 16)
    remote = RemoteTier(valkey.url, LAYOUT, 16)
    for i in (0, 1):
        disk.submit(key(i), bytes([i]) * 16)
    for i in (2, 3, 5):  # 4 is nowhere: the chain breaks there
        remote.submit(key(i), bytes([i]) * 16)
    assert disk.flush() and remote.flush()
    p = Prefetcher(disk, remote, capacity=3)
    assert p.submit(7, [key(i) for i in range(6)]) and p.flush()
    assert len(p) == 3  # capacity: the oldest staged block (key 0) went first
    assert p.take(key(0)) is None
    got = [p.take(key(i)) for i in (1, 2, 3)]
    assert [(s.tier, s.payload) for s in got if s] == [
        ("disk", b"\x01" * 16), ("remote", b"\x02" * 16), ("remote", b"\x03" * 16)]
    assert p.take(key(5)) is None and len(p) == 0
    assert disk.counters.get("prefetched") == 2 and remote.counters.get("prefetched") == 2
    p.enabled = False
    assert not p.submit(8, [key(1)])
    p.enabled = True
    assert p.submit(9, [key(1)]) and p.clear() == 1
    p.cancel(10)  # not queued: nothing to remember
    assert not p._cancelled
    p.close()
    disk.close()
    remote.close()
    with pytest.raises(ValueError, match="kv_prefetch_blocks"):
        Prefetcher(None, None, 0)


@pytest.mark.parametrize("source", ["disk", "remote"])
def test_queued_requests_are_prefetched(
    source: str, make_llm: Any, tokens: Any, tmp_path: Path, valkey: Any
) -> None:
    kw = {"kv_disk_dir": tmp_path} if source == "disk" else {"kv_remote": valkey.url}
    llm = make_llm(block_size=16, max_num_seqs=1, **kw)
    prompts = [tokens(10 + i, 200) for i in range(4)]
    cold = llm.generate(prompts, GREEDY)
    tiers = llm.engine.kv.tiers
    assert tiers.flush()
    llm.reset_prefix_cache()  # the pool is empty: only the disk / remote tier has the blocks
    warm = llm.generate(prompts, GREEDY)  # one runs at a time; the others wait and prefetch
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    assert all(o.num_cached_tokens == 192 for o in warm)
    stats = next(t for t in llm.get_stats().tiers if t.tier == source)
    assert stats.prefetched > 0 and stats.hits == 4 * 12
    assert len(tiers.prefetcher) == 0 or tiers.prefetcher.flush()
    llm.engine.close()


def test_prefetch_off(make_llm: Any, tmp_path: Path) -> None:
    llm = make_llm(kv_disk_dir=tmp_path, kv_offload_size=16)
    assert llm.engine.kv.tiers.prefetcher is not None
    from prefixkv.tiers.spec import TierSpec

    with pytest.raises(ValueError, match="kv_prefetch_blocks"):
        TierSpec(prefetch_blocks=-1)
    assert make_llm(kv_offload_size=16).engine.kv.tiers.prefetcher is None  # host only: nothing to read
    llm.engine.close()
