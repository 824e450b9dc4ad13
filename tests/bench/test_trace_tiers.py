"""Tiered trace replay (issue 11): the pool row is the plain replay, an unbounded tier reaches
the unbounded cache, more tier capacity never hurts, and the cost model adds up."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixkv.bench.trace import load_trace, replay
from prefixkv.bench.trace_tiers import replay_tiered

TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "mooncake_conversation_trace.jsonl"


@pytest.fixture(scope="module")
def requests():  # type: ignore[no-untyped-def]
    return load_trace(TRACE)[:1500]


def test_the_pool_tier_is_the_plain_lru_replay(requests) -> None:  # type: ignore[no-untyped-def]
    plain = replay(requests, 300_000, "lru", index="radix")
    row = replay_tiered(requests, [300_000, 512])
    assert row.hit_rates[0] == pytest.approx(plain.hit_rate)


def test_a_large_enough_tier_reaches_the_unbounded_cache(requests) -> None:  # type: ignore[no-untyped-def]
    unbounded = replay(requests, None, "lru", index="radix").hit_rate
    pool_only = replay(requests, 300_000, "lru", index="radix").hit_rate
    row = replay_tiered(requests, [300_000, 10**9])
    assert pool_only < row.hit_rate == pytest.approx(unbounded)
    assert row.hit_rates[1] > 0


def test_more_tier_capacity_never_lowers_the_hit_rate(requests) -> None:  # type: ignore[no-untyped-def]
    rates = [replay_tiered(requests, [300_000, t]).hit_rate for t in (600_000, 1_500_000, 6_000_000)]
    assert rates == sorted(rates)
    three = replay_tiered(requests, [300_000, 600_000, 6_000_000])  # host + disk below it
    assert three.hit_rate >= rates[0] and three.hit_rates[2] > 0


def test_the_cost_model(requests) -> None:  # type: ignore[no-untyped-def]
    row = replay_tiered(requests, [300_000, 3_000_000], bandwidths_gbps=[10.0],
                        prefill_tokens_per_s=1000.0, kv_bytes_per_token=1_000_000)
    loaded = row.hit_rates[1] * row.input_tokens
    assert row.prefill_s_no_cache == pytest.approx(row.input_tokens / 1000.0)
    assert row.load_s == pytest.approx(loaded * 1_000_000 / 10e9)
    assert row.prefill_s_tiered == pytest.approx(
        row.prefill_s_no_cache * (1 - row.hit_rate) + row.load_s)
    assert row.prefill_s_tiered < row.prefill_s_pool_only < row.prefill_s_no_cache


@pytest.mark.parametrize("kwargs", [{"capacities_tokens": []}, {"capacities_tokens": [100]},
                                    {"capacities_tokens": [1024, 1024], "bandwidths_gbps": [0]}])
def test_bad_arguments_are_value_errors(requests, kwargs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        replay_tiered(requests[:5], **kwargs)
