"""``python -m prefixkv.bench.ops_policies``: rows, ratios, the logical clock, argument errors.

Timings are not asserted (the per-op target lives in the benchmark, docs/benchmarks.md); the
runs are tiny.
"""

from __future__ import annotations

import pytest

from prefixkv.bench import ops_policies
from prefixkv.cache.policies import LRUPolicy
from prefixkv.cache.policy_experts import ExpertsPolicy
from prefixkv.cache.policy_ghost import GhostPolicy

POLICIES = ("lru", "experts", "ghost", "experts[lru2]")


@pytest.fixture(scope="module")
def rows() -> list[ops_policies.PolicyOpsRow]:
    return ops_policies.run_policy_ops(POLICIES, prompts=40, iters=20, evicts=2, rounds=2)


def test_rows_in_order_with_ratios_to_the_first(rows: list[ops_policies.PolicyOpsRow]) -> None:
    assert [r.policy for r in rows] == list(POLICIES)
    for r in rows:
        assert r.match_us > 0 and r.insert_us > 0 and r.evict_us > 0
        assert r.evict_ratio == pytest.approx(r.evict_us / rows[0].evict_us)
        assert r.evict_entries >= 10  # 640 blocks: 10 prompts of 64, or more smaller entries
    assert rows[0].match_ratio == rows[0].insert_ratio == rows[0].evict_ratio == 1.0


def test_forced_expert_is_reported(rows: list[ops_policies.PolicyOpsRow]) -> None:
    by = {r.policy: r for r in rows}
    assert by["lru"].chosen is None and by["ghost"].chosen is None
    assert by["experts[lru2]"].chosen == "lru2"
    assert by["experts"].chosen is not None


def test_only_the_asked_ops_are_timed() -> None:
    rows = ops_policies.run_policy_ops(("lru", "experts[tail]"), prompts=40, evicts=2,
                                       rounds=1, ops_to_time=("evict",), evict_blocks=10)
    assert all(r.match_us == 0 and r.insert_us == 0 and r.evict_us > 0 for r in rows)
    assert rows[1].chosen == "tail"


def test_named_policies() -> None:
    assert isinstance(ops_policies.make_named_policy("lru"), LRUPolicy)
    assert isinstance(ops_policies.make_named_policy("ghost"), GhostPolicy)
    p = ops_policies.make_named_policy("experts[rate]")
    assert isinstance(p, ExpertsPolicy) and p.chosen == "rate" and len(p.experts) == 8


@pytest.mark.parametrize("name", ["experts[nope]", "nope", "experts["])
def test_unknown_policy_is_a_value_error(name: str) -> None:
    with pytest.raises(ValueError, match="unknown"):
        ops_policies.make_named_policy(name)


@pytest.mark.parametrize("kwargs", [{"rounds": 0}, {"evicts": 0}, {"evict_blocks": 0},
                                    {"clock_step": 0.0}, {"ops_to_time": ("scan",)}])
def test_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ops_policies.run_policy_ops(("lru",), prompts=20, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ops_policies.run_policy_ops((), prompts=20)


def test_step_clock_moves_by_its_step() -> None:
    clock = ops_policies.StepClock(0.5)
    assert (clock(), clock(), clock()) == (0.5, 1.0, 1.5)


def test_main_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    out: list[str] = []
    assert ops_policies.main(["--policies", "lru", "experts[s2]", "--ops", "evict",
                              "--prompts", "40", "--evicts", "2", "--rounds", "1"],
                             out=out.append) == 0
    lines = out[0].splitlines()
    assert lines[0].startswith("policy") and "entries/evict" in lines[0]
    assert lines[1].startswith("lru") and "1.00x" in lines[1] and lines[2].endswith("s2")
    with pytest.raises(SystemExit):
        ops_policies.main(["--policies", "bogus"])
    assert "unknown policy" in capsys.readouterr().err
