"""The schedule-policy benchmark: workload structure and a small real run of two policies."""

from __future__ import annotations

import pytest

from prefixkv.bench.scheduling import WORKLOADS, compare, format_table, mixed_workload


def test_mixed_workload_interleaves_and_points_follow_ups_back() -> None:
    work = mixed_workload(scale=1, seed=0, instances=2)
    assert len(work) == 2 * (6 + 6 + 6 + 8)  # few-shot, self-consistency, tree, 2 x 4 turns
    for i, (req, dep) in enumerate(work):
        assert (dep is None) == (req.follow_up is None)
        if dep is not None:
            assert dep < i and work[dep][0].max_tokens == req.max_tokens
    # interleaved: the first len(groups) requests come from different groups
    firsts = [r.prompt[:8] for r, _ in work[: 2 * len(WORKLOADS)]]
    assert len({tuple(f) for f in firsts}) == len(firsts)


@pytest.mark.slow  # 26 requests through the demo engine twice
def test_policies_compute_the_same_outputs_with_different_reuse() -> None:
    rows = compare(["fcfs", "lpm"], rounds=1, num_kv_blocks=48, scale=1, seed=1, instances=1,
                   engine_kwargs={"max_num_batched_tokens": 512})
    fcfs, lpm = rows
    assert fcfs.requests == lpm.requests == 26
    assert fcfs.prompt_tokens == lpm.prompt_tokens  # same follow-ups: outputs did not change
    for r in rows:
        assert 0 < r.computed_tokens <= r.prompt_tokens and r.tokens_per_s > 0
    table = format_table(rows)
    assert "fcfs" in table and "lpm" in table and "1.00x" in table
