"""The end-to-end retention benchmark (prefixkv/bench/retention.py) at a tiny size, on the real
engine and demo model: its rows, equal work, and that retention matters where it must."""

from __future__ import annotations

import pytest

from prefixkv.bench.retention import ROWS, Step, chat_steps, format_table, run, step_gaps


def test_chat_steps_round_robin() -> None:
    steps = chat_steps(3, 2, system=4, context=4, user=2, seed=1)
    assert [s.session for s in steps] == [0, 1, 2, 0, 1, 2]
    assert [s.append for s in steps] == [False] * 3 + [True] * 3
    assert steps[0].tokens[:4] == steps[1].tokens[:4]  # the shared system prompt
    assert step_gaps(steps) == [3, 3, 3]
    with pytest.raises(ValueError, match="sessions"):
        chat_steps(0, 2)


def test_retaining_session_keeps_its_context_under_pressure() -> None:
    # 4 sessions round-robin, a pool holding under half of them, LRU: the policy alone evicts
    # every session's context before its next turn; the retaining one (TTL far past the run)
    # must keep its context between turns.
    steps = chat_steps(4, 3, system=16, context=160, user=16, seed=0)
    rows, facts = run(steps, num_kv_blocks=40, share=0.25, ttl_s=600.0, policy="lru",
                      max_tokens=4)
    assert [r.name for r in rows] == list(ROWS)
    assert facts["retaining_sessions"] >= 1 and facts["sessions"] == 4
    alone, _, share = rows
    for r in rows:
        assert r.total.requests == len(steps)
        assert r.retaining.requests + r.others.requests == len(steps)
        assert len(r.total.ttfts_ms) == len(steps)
    # equal work: the same prompts in every row (greedy answers of the same weights)
    assert len({r.total.prompt_tokens for r in rows}) == 1
    assert share.retaining.hit_rate > alone.retaining.hit_rate
    assert share.retaining.hit_rate >= share.others.hit_rate
    assert share.retained_blocks_end > 0 and alone.retained_blocks_end == 0
    assert "share" in format_table(rows, facts)


def test_run_rejects_bad_share() -> None:
    with pytest.raises(ValueError, match="share"):
        run([Step(0, (1, 2, 3), False)], num_kv_blocks=8, share=0.0)
