"""Belady's offline optimum: an upper bound for every online policy, through the same core."""

from __future__ import annotations

import random

import pytest

from prefixkv.bench.belady import BeladyPolicy
from prefixkv.bench.trace import TraceRequest, online_policy_names, replay


def _random_trace(seed: int, n: int = 60, bs: int = 4) -> list[TraceRequest]:
    """Conversation-like chains: new sessions (after an optional shared prefix), returning
    sessions that grow, and some that come back with a shorter prefix."""
    rng = random.Random(seed)
    counter = iter(range(1, 1 << 30))
    shared = [next(counter) for _ in range(rng.randint(0, 2))]
    sessions: list[list[int]] = []
    out = []
    for i in range(n):
        if sessions and rng.random() < 0.6:
            s = rng.choice(sessions)
            s.extend(next(counter) for _ in range(rng.randint(0, 3)))
            ids = s[: rng.randint(1, len(s))] if rng.random() < 0.3 else list(s)
        else:
            ids = shared + [next(counter) for _ in range(rng.randint(1, 5))]
            sessions.append(list(ids))
        out.append(TraceRequest(float(i * 1000), len(ids) * bs - rng.randint(0, bs - 1), 1,
                                tuple(ids)))
    return out


@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("seed", range(12))
def test_belady_matches_at_least_as_many_blocks_as_any_policy(index: str, seed: int) -> None:
    t = _random_trace(seed)
    for cap in (12, 24, 40):
        best = replay(t, cap, "belady", block_size=4, index=index).hit_blocks
        for p in online_policy_names():
            assert replay(t, cap, p, block_size=4, index=index).hit_blocks <= best, (p, cap)


def test_belady_reaches_the_unbounded_hit_rate_once_everything_fits() -> None:
    t = _random_trace(3)
    n_blocks = len({h for r in t for h in r.hash_ids})
    assert replay(t, n_blocks * 4, "belady", block_size=4).hit_tokens == replay(
        t, None, block_size=4).hit_tokens


def test_next_use_is_strictly_after() -> None:
    reqs = [TraceRequest(0, 2, 1, (1, 2)), TraceRequest(1, 1, 1, (1,)),
            TraceRequest(2, 2, 1, (1, 2))]
    pol = BeladyPolicy.for_trace(reqs, [0.0, 1.0, 2.0])
    assert pol.next_use(1, 0.0) == 1.0
    assert pol.next_use(2, 0.0) == 2.0
    assert pol.next_use(2, 2.0) == float("inf")
    assert pol.next_use(99, 0.0) == float("inf")
    with pytest.raises(ValueError, match="times"):
        BeladyPolicy.for_trace(reqs, [0.0])
