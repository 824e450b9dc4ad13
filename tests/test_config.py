"""EngineConfig: sections validated at construction, flat vLLM-style names, unknown names named."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from prefixkv import EngineConfig
from prefixkv.config import OPTIONS, CacheSettings, ModelSettings, SchedulerSettings
from prefixkv.tiers.spec import TierSpec


def test_defaults_are_the_documented_ones() -> None:
    c = EngineConfig()
    assert (c.cache.block_size, c.cache.index, c.cache.eviction_policy) == (16, "radix", "lru")
    assert c.cache.enable_prefix_caching and c.cache.max_pinned_blocks is None
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (64, 4096)
    assert c.scheduler.schedule_policy == "fcfs" and c.model.seed == 0
    assert not c.tiers.enabled


def test_flat_names_land_in_their_sections() -> None:
    c = EngineConfig.from_kwargs("m", block_size=4, max_num_seqs=3, kv_offload_size="2GiB",
                                 kv_remote_timeout=0.25, dtype="auto", kv_cache_memory="1KiB")
    assert c.model.model == "m" and c.model.dtype is None  # "auto" = the device default
    assert c.cache.block_size == 4 and c.cache.kv_cache_memory == 1024
    assert c.scheduler.max_num_seqs == 3
    assert c.tiers == TierSpec(offload_size="2GiB", remote_timeout=0.25)
    assert EngineConfig.from_kwargs(**c.to_kwargs()) == c
    assert c.replace(block_size=8).cache.block_size == 8 and c.cache.block_size == 4
    alias = EngineConfig.from_kwargs(kv_cache_memory_bytes=2048)
    assert alias.cache.kv_cache_memory == 2048


def test_unknown_name_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"'max_num_seq'.*did you mean 'max_num_seqs'"):
        EngineConfig.from_kwargs(max_num_seq=4)
    with pytest.raises(TypeError, match="'frobnicate'"):
        EngineConfig.from_kwargs(frobnicate=1)


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"block_size": 0}, "block_size"),
    ({"block_size": True}, "block_size"),
    ({"num_kv_blocks": -1}, "num_kv_blocks"),
    ({"index": "btree"}, "index"),
    ({"eviction_policy": "mru"}, "eviction_policy"),
    ({"hash_algo": "md5"}, "hash_algo"),
    ({"max_pinned_blocks": -2}, "max_pinned_blocks"),
    ({"max_pinned_blocks_per_tenant": 1.5}, "max_pinned_blocks_per_tenant"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": "many"}, "max_num_batched_tokens"),
    ({"schedule_policy": "random"}, "schedule_policy"),
    ({"threads": 0}, "threads"),
    ({"tune_malloc": "yes"}, "tune_malloc"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"seed": -1}, "seed"),
    ({"device": 3}, "device"),
    ({"model": 42}, "model"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ({"kv_remote": "http://x"}, "kv_remote"),
    ({"kv_remote_timeout": 0}, "kv_remote_timeout"),
    ({"kv_offload_size": "huge"}, "kv_offload_size"),
    ({"kv_disk_size": 10}, "kv_disk_size"),
])
def test_bad_values_raise_value_error_naming_the_field(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        EngineConfig.from_kwargs(**kwargs)


def test_checks_across_fields() -> None:
    with pytest.raises(ValueError, match="not both"):
        EngineConfig.from_kwargs(num_kv_blocks=8, kv_cache_memory="1MiB")
    with pytest.raises(ValueError, match="not both"):
        EngineConfig.from_kwargs(kv_cache_memory="1MiB", kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="need prefix caching"):
        EngineConfig.from_kwargs(enable_prefix_caching=False, kv_offload_size=64)
    with pytest.raises(ValueError, match="EngineConfig.cache must be a CacheSettings"):
        EngineConfig(cache=SchedulerSettings())  # type: ignore[arg-type]


def test_sections_are_frozen_and_checked_alone() -> None:
    c = CacheSettings(block_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerSettings(max_num_seqs=-1)
    assert ModelSettings(dtype="bfloat16").dtype == "bfloat16"


def test_options_cover_every_section_field_once() -> None:
    fields = {(s, f.name) for s, cls in (("model", ModelSettings), ("cache", CacheSettings),
                                          ("scheduler", SchedulerSettings), ("tiers", TierSpec))
              for f in dataclasses.fields(cls)}
    assert {(o.section, o.field) for o in OPTIONS.values()} == fields
    assert len(OPTIONS) == len(fields)
    for o in OPTIONS.values():
        assert getattr(getattr(EngineConfig(), o.section), o.field) == o.default


def test_schedule_policies_match_the_scheduler() -> None:
    from prefixkv.config import SCHEDULE_POLICIES
    from prefixkv.engine.schedule_policy import SCHEDULE_POLICIES as ENGINE_POLICIES

    assert SCHEDULE_POLICIES == ENGINE_POLICIES


def test_config_imports_no_torch() -> None:
    code = "import sys, prefixkv.config, prefixkv; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
