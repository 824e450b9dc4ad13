"""Lower KV tiers in the engine: greedy outputs are token-identical whether a prefix's KV came
from the pool, the host tier (L2) or the disk tier (L3); block accounting stays exact; a
restarted engine answers from disk; corrupt / truncated files are misses, never wrong KV.
(The shared Valkey tier's engine tests live in tests/tiers/test_remote_engine.py.)
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from prefixkv.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def workload(helpers: Any) -> list[list[int]]:
    return helpers.shared_prefix_workload(8)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reference(demo_model: Any, helpers: Any) -> list[list[int]]:
    llm = LLM(demo_model, enable_prefix_caching=False, num_kv_blocks=256)
    return [o.outputs[0].token_ids for o in llm.generate(workload(helpers), GREEDY)]


def tier(llm: LLM, name: str) -> Any:
    stats = llm.get_stats().tiers
    assert stats is not None
    return next(t for t in stats if t.tier == name)


def run(llm: LLM, helpers: Any, reference: list[list[int]]) -> list[int]:
    outs = llm.generate(workload(helpers), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    helpers.assert_no_leak(llm)
    host = llm.engine.kv.tiers.host
    if host is not None:  # no slot stays held; the LRU keeps to its capacity
        assert host.num_held == 0 and len(host) <= host.capacity
    return [o.num_cached_tokens for o in outs]


CONFIGS = {
    "radix-bs16": dict(index="radix", block_size=16),
    "radix-bs4": dict(index="radix", block_size=4),
    "hash-bs16": dict(index="hash", block_size=16),
    "hash-bs4": dict(index="hash", block_size=4),
    "radix-bs4-chunked": dict(index="radix", block_size=4, max_num_batched_tokens=24, max_num_seqs=3),
    "hash-bs16-chunked": dict(index="hash", block_size=16, max_num_batched_tokens=20),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_host_tier_hits_are_token_identical(
    name: str, make_llm: Any, helpers: Any, reference: list[list[int]]
) -> None:
    llm = make_llm(kv_offload_size=256, **CONFIGS[name])
    run(llm, helpers, reference)
    spilled = llm.engine.kv.spill()
    assert spilled > 0 and llm.engine.kv.cache.num_cached_blocks == 0
    cached = run(llm, helpers, reference)  # every shared block now comes from host memory
    host = tier(llm, "host")
    assert host.stored_blocks == spilled and host.hits > 0
    assert host.loaded_bytes == host.hits * llm.engine.kv.tiers.transfer.block_nbytes
    assert sum(cached) >= host.hit_tokens > 0  # host tokens count as cached tokens
    assert llm.get_stats().num_cached_prompt_tokens >= host.hit_tokens


def test_prompt_logprobs_and_skip_reading_compute_the_prompt_not_read_a_tier(
    make_llm: Any, helpers: Any, demo_model: Any
) -> None:
    # the prompt is held only in host memory: a request for its prompt logprobs used to take
    # it from there, leaving 192 of 200 entries None; one that skips reading does not read it
    prompt = helpers.tokens(3, 200)
    cold = LLM(demo_model, enable_prefix_caching=False, num_kv_blocks=64)
    ask = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    want = cold.generate({"prompt_token_ids": prompt}, ask)[0]
    llm = make_llm(kv_offload_size=256, block_size=16)
    ref = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    assert llm.engine.kv.spill() > 0
    out = llm.generate({"prompt_token_ids": prompt}, ask)[0]
    assert out.num_cached_tokens == 0 and tier(llm, "host").hits == 0
    assert out.prompt_logprobs is not None and want.prompt_logprobs is not None
    assert all(e is not None for e in out.prompt_logprobs[1:])
    for got, exp in zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert got is not None and exp is not None and got.keys() == exp.keys()
        assert [g.logprob for g in got.values()] == pytest.approx([e.logprob for e in exp.values()], abs=1e-4)
    assert llm.engine.kv.spill() > 0
    skip = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, skip_reading_prefix_cache=True)
    out = llm.generate({"prompt_token_ids": prompt}, skip)[0]
    assert out.num_cached_tokens == 0 and tier(llm, "host").hits == 0 and out.outputs[0].token_ids == ref
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]  # it still filled the cache
    assert again.num_cached_tokens >= 192 and again.outputs[0].token_ids == ref
    helpers.assert_no_leak(llm)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_disk_tier_hits_are_token_identical(
    name: str, make_llm: Any, helpers: Any, reference: list[list[int]], tmp_path: Path
) -> None:
    llm = make_llm(kv_disk_dir=tmp_path, **CONFIGS[name])
    run(llm, helpers, reference)
    assert llm.engine.kv.tiers.flush()
    assert llm.engine.kv.spill() > 0  # no host tier: evicted blocks are only on disk now
    cached = run(llm, helpers, reference)
    disk = tier(llm, "disk")
    assert disk.hits > 0 and sum(cached) >= disk.hit_tokens
    llm.engine.close()


@pytest.mark.parametrize("index,bs,blocks", [("radix", 16, 10), ("hash", 4, 40)])
def test_tiny_pool_with_host_and_disk(
    index: str, bs: int, blocks: int, make_llm: Any, helpers: Any, reference: list[list[int]],
    tmp_path: Path,
) -> None:
    """Eviction and preemption during the run itself: blocks go down and come back up."""
    llm = make_llm(index=index, block_size=bs, num_kv_blocks=blocks, kv_offload_size=8,
                   kv_disk_dir=tmp_path)
    for _round in range(3):
        run(llm, helpers, reference)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.cache is not None and stats.cache.evicted_blocks > 0
    host, disk = tier(llm, "host"), tier(llm, "disk")
    assert host.evictions > 0 and host.occupancy_blocks == 8  # L2 full: its own LRU at work
    assert host.hits + disk.hits > 0
    llm.engine.close()


def test_warm_restart_from_disk(make_llm: Any, helpers: Any, tmp_path: Path) -> None:
    prompt = helpers.tokens(42, 700)
    first = make_llm(kv_disk_dir=tmp_path, kv_disk_size="64MiB")
    cold = first.generate([prompt], GREEDY)[0]
    assert cold.num_cached_tokens == 0
    first.engine.close()  # queued writes land before the "restart"
    files = list(tmp_path.glob("*.kvb"))
    assert len(files) == (700 + 4 - 1) // 16  # prompt and generated blocks (the last token has no KV)
    second = make_llm(kv_disk_dir=tmp_path)
    warm = second.generate([prompt], GREEDY)[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.num_cached_tokens == (700 - 1) // 16 * 16  # the last prompt token is computed
    assert tier(second, "disk").hits == (700 - 1) // 16
    helpers.assert_no_leak(second)
    second.engine.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_corrupt_disk_files_are_misses(
    damage: str, make_llm: Any, helpers: Any, tmp_path: Path
) -> None:
    prompt = helpers.tokens(43, 200)
    first = make_llm(kv_disk_dir=tmp_path)
    cold = first.generate([prompt], GREEDY)[0]
    first.engine.close()
    tiers = first.engine.kv.tiers
    keys = first.engine.kv._chains.get(0) or tiers.keyer.extend([], prompt, 12, None)
    victim = tiers.disk.path(keys[5])  # block 5: blocks 0-4 still load, 5.. are recomputed
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    victim.write_bytes(bytes(data))
    second = make_llm(kv_disk_dir=tmp_path)
    warm = second.generate([prompt], GREEDY)[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.num_cached_tokens == 5 * 16
    disk = tier(second, "disk")
    assert disk.corrupt == 1 and disk.hits == 5
    second.engine.close()
    assert victim.read_bytes() != bytes(data)  # removed, then written again from the recompute
    third = make_llm(kv_disk_dir=tmp_path)  # the block was recomputed and written again
    again = third.generate([prompt], GREEDY)[0]
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    assert again.num_cached_tokens == 12 * 16
    third.engine.close()


def test_namespaces_do_not_share_lower_tiers(make_llm: Any, helpers: Any, tmp_path: Path) -> None:
    prompt = helpers.tokens(44, 100)
    llm = make_llm(kv_offload_size="8MiB", kv_disk_dir=tmp_path)
    llm.generate([prompt], GREEDY, cache_salt="a")
    llm.engine.kv.spill()
    other = llm.generate([prompt], GREEDY, cache_salt="b")[0]
    assert other.num_cached_tokens == 0
    same = llm.generate([prompt], GREEDY, cache_salt="a")[0]
    assert same.num_cached_tokens == 96
    llm.engine.close()


def test_reset_clears_host_tier(make_llm: Any, helpers: Any) -> None:
    llm = make_llm(kv_offload_size=64)
    llm.generate([helpers.tokens(45, 100)], GREEDY)
    llm.engine.kv.spill()
    assert tier(llm, "host").occupancy_blocks > 0
    llm.reset_prefix_cache()
    assert tier(llm, "host").occupancy_blocks == 0


def test_bad_tier_arguments(make_llm: Any) -> None:
    with pytest.raises(ValueError, match="kv_offload_size"):
        make_llm(kv_offload_size="lots")
    with pytest.raises(ValueError, match="kv_disk_size needs kv_disk_dir"):
        make_llm(kv_disk_size="1GiB")
    with pytest.raises(ValueError, match="kv_remote"):
        make_llm(kv_remote="http://localhost:6379")
    with pytest.raises(ValueError, match="prefix caching"):
        make_llm(kv_offload_size=16, enable_prefix_caching=False)


def test_no_tiers_reports_none(make_llm: Any) -> None:
    assert make_llm().get_stats().tiers is None


def test_failed_tier_load_recomputes(make_llm: Any, helpers: Any, reference: list[list[int]],
                                     monkeypatch: Any) -> None:
    """A load that raises (fault injected into the copy) costs a recompute, not the request."""
    llm = make_llm(kv_offload_size=256)
    run(llm, helpers, reference)
    llm.engine.kv.spill()

    def broken(*_: Any) -> None:
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(llm.engine.kv.tiers.transfer, "from_host", broken)
    cached = run(llm, helpers, reference)
    assert tier(llm, "host").hits == 0
    assert max(cached) > 0  # later prompts still hit the blocks recomputed by earlier ones


def test_unserialisable_namespace_uses_the_pool_only(make_llm: Any, helpers: Any) -> None:
    llm = make_llm(kv_offload_size=64)
    prompt = helpers.tokens(46, 100)
    first = llm.generate([prompt], GREEDY, lora_id=1.5)[0]  # a float has no stable tier key
    llm.engine.kv.spill()
    again = llm.generate([prompt], GREEDY, lora_id=1.5)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 0 and tier(llm, "host").stored_blocks == 0
    helpers.assert_no_leak(llm)


@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_ops_keep_outputs_and_accounting(
    seed: int, make_llm: Any, demo_model: Any, helpers: Any, tmp_path: Path
) -> None:
    """Random batches over a few shared prefixes, random spills and resets, a tiny pool, a
    tiny host tier and a disk tier: outputs equal the no-cache reference every time, every
    pool block is free or cached once idle, no host slot stays held, tiers keep capacity."""
    import random

    rng = random.Random(seed)
    bases = [helpers.tokens(200 + i, 24 + 16 * i) for i in range(3)]
    prompts = [rng.choice(bases) + helpers.tokens(300 + j, rng.randrange(1, 20)) for j in range(12)]
    ref_llm = LLM(demo_model, enable_prefix_caching=False, num_kv_blocks=256)
    ref = {j: o.outputs[0].token_ids for j, o in enumerate(ref_llm.generate(prompts, GREEDY))}
    llm = make_llm(index=rng.choice(["radix", "hash"]), block_size=rng.choice([4, 16]),
                   num_kv_blocks=40, kv_offload_size=6, kv_disk_dir=tmp_path, kv_disk_size=30,
                   max_num_batched_tokens=rng.choice([16, 64]))
    kv = llm.engine.kv
    for _op in range(8):
        batch = rng.sample(range(len(prompts)), rng.randrange(1, 5))
        outs = llm.generate([prompts[j] for j in batch], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [ref[j] for j in batch]
        helpers.assert_no_leak(llm)
        assert kv.tiers.host.num_held == 0 and len(kv.tiers.host) <= 6
        action = rng.random()
        if action < 0.4:
            kv.spill(rng.randrange(1, 20))
        elif action < 0.5:
            llm.reset_prefix_cache()
    assert kv.tiers.flush() and len(kv.tiers.disk) <= 30
    assert tier(llm, "host").hits + tier(llm, "disk").hits > 0
    assert len(list(tmp_path.glob("*.kvb"))) == len(kv.tiers.disk)
    llm.engine.close()


EXIT_SCRIPT = """
import sys
from prefixkv.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_disk_dir=sys.argv[2], num_kv_blocks=1100)
prompts = [[32 + (7 * i + 13 * j) % 95 for j in range(1000)] for i in range(16)]
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
"""  # and exits at once: no close(), queued disk writes still in flight


def test_a_script_that_exits_without_close_leaves_its_disk_tier_complete(
    demo_model: Path, make_llm: Any, tmp_path: Path
) -> None:
    """Interpreter exit waits for the queued writes (they were lost before: about half of
    them, so a rerun of the script recomputed half its prompts)."""
    subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(demo_model), str(tmp_path)],
                   check=True, timeout=300)
    assert len(list(tmp_path.glob("*.kvb"))) == 16 * (1000 // 16)  # every full block
    rerun = make_llm(kv_disk_dir=tmp_path, num_kv_blocks=1100)
    prompts = [[32 + (7 * i + 13 * j) % 95 for j in range(1000)] for i in range(16)]
    outs = rerun.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    assert [o.num_cached_tokens for o in outs] == [1000 // 16 * 16] * 16
    rerun.close()


def test_a_dropped_llm_writes_its_queue_and_stops_its_threads(
    make_llm: Any, helpers: Any, tmp_path: Path
) -> None:
    before = set(threading.enumerate())
    llm = make_llm(kv_disk_dir=tmp_path, kv_offload_size=64)
    llm.generate([helpers.tokens(44, 500)], GREEDY)
    threads = helpers.new_threads(before)
    assert threads  # the disk writer and the prefetcher
    del llm
    gc.collect()
    assert helpers.all_end(threads)  # were left running for the life of the process
    assert len(list(tmp_path.glob("*.kvb"))) == (500 + 4 - 1) // 16


def test_leaving_a_with_block_closes_the_llm(make_llm: Any, helpers: Any, tmp_path: Path) -> None:
    before = set(threading.enumerate())
    prompt = helpers.tokens(45, 300)
    with make_llm(kv_disk_dir=tmp_path) as llm:
        cold = llm.generate([prompt], GREEDY)[0]
        threads = helpers.new_threads(before)
    assert threads and not any(t.is_alive() for t in threads)  # joined by close()
    assert len(list(tmp_path.glob("*.kvb"))) == (300 + 4 - 1) // 16
    warm = llm.generate([prompt], GREEDY)[0]  # still usable: the pool and the host tier
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.num_cached_tokens == (300 - 1) // 16 * 16
    llm.close()  # idempotent


def test_a_bad_remote_url_refuses_the_engine_and_stops_the_disk_tier_it_started(
    make_llm: Any, helpers: Any, tmp_path: Path
) -> None:
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="not a valid redis URL"):
        make_llm(kv_disk_dir=tmp_path, kv_remote="redis://127.0.0.1:99999")
    gc.collect()
    assert helpers.all_end(helpers.new_threads(before))  # the disk writer ran on after the error
