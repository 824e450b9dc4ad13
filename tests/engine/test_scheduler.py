"""Scheduler + KVManager without a model: budgets, chunking, preemption, partial copies."""

from __future__ import annotations

from prefixkv.cache import make_cache
from prefixkv.engine.kv_manager import KVManager
from prefixkv.engine.outputs import RequestMetrics
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.scheduler import Scheduler, SchedulerOutput
from prefixkv.engine.sequence import Request, Sequence, SequenceStatus


class Rows:
    """Records copy_rows calls (the runner's copy_block_rows has no observable effect here)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, src: int, dst: int, n: int) -> None:
        self.calls.append((src, dst, n))


def setup(num_blocks: int, block_size: int, budget: int, max_seqs: int = 8) -> tuple[Scheduler, Rows]:
    rows = Rows()
    cache = make_cache("radix", max_blocks=num_blocks, block_size=block_size, max_pinned_blocks=num_blocks)
    kv = KVManager(num_blocks, block_size, cache, rows)
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, clock=lambda: 0.0), rows


def seq_of(tokens: list[int], rid: str = "r") -> Sequence:
    req = Request(rid, None, tokens, SamplingParams(), 16, None, RequestMetrics(0.0))
    seq = Sequence(0, req, 0, req.params, list(tokens), len(tokens))
    req.seqs.append(seq)
    return seq


def run_step(sched: Scheduler, plan: SchedulerOutput, next_token: int = 7) -> None:
    """What the engine does after the model ran: advance, commit, sample at the end."""
    for s in plan.scheduled:
        seq = s.seq
        seq.num_computed_tokens += s.num_new_tokens
        sched.kv.commit(seq)
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(next_token)


def test_long_prompt_is_chunked_under_the_budget() -> None:
    sched, _ = setup(num_blocks=64, block_size=4, budget=10)
    seq = seq_of(list(range(25)))
    sched.add(seq)
    sizes = []
    while seq.num_computed_tokens < 25:
        plan = sched.schedule()
        sizes.append(plan.num_batched_tokens)
        run_step(sched, plan)
    assert sizes == [10, 10, 5]
    assert len(seq.token_ids) == 26 and seq.num_indexed_blocks == 6
    sched.finish(seq)
    kv = sched.kv
    assert kv.pool.num_free + kv.cache.num_cached_blocks == 64  # type: ignore[union-attr]


def test_preemption_requeues_newest_and_readmission_hits_cache() -> None:
    sched, _ = setup(num_blocks=6, block_size=4, budget=64)
    a, b = seq_of(list(range(10)), "a"), seq_of(list(range(100, 110)), "b")
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # both prefilled: 3 blocks each, pool empty
    for _ in range(2):  # decodes at positions 10 and 11 fit in the 3 blocks
        run_step(sched, sched.schedule())
    assert sched.num_preemptions == 0
    plan = sched.schedule()  # position 12 needs a 4th block: b (the newest) is preempted
    assert sched.num_preemptions == 1 and plan.preempted == [b]
    assert [s.seq for s in plan.scheduled] == [a] and len(a.block_table) == 4
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b and b.block_table == []
    run_step(sched, plan)
    sched.finish(a)
    plan = sched.schedule()
    assert plan.scheduled[0].seq is b
    assert b.num_computed_tokens >= 8  # its committed blocks were still cached


def test_partial_block_rows_are_copied() -> None:
    sched, rows = setup(num_blocks=32, block_size=8, budget=64)
    first = seq_of(list(range(20)), "a")
    sched.add(first)
    run_step(sched, sched.schedule())
    sched.finish(first)
    second = seq_of(list(range(11)) + [99] * 5, "b")  # shares 11 tokens: 1 block + 3 rows
    sched.add(second)
    plan = sched.schedule()
    assert second.num_computed_tokens == 11 and second.request.num_cached_tokens == 11
    assert len(rows.calls) == 1
    src, dst, n = rows.calls[0]
    assert (dst, n) == (second.block_table[1], 3) and src != dst
    assert plan.scheduled[0].num_new_tokens == 5


def test_unfittable_waiting_sequence_is_aborted() -> None:
    sched, _ = setup(num_blocks=4, block_size=4, budget=64)
    cache = sched.kv.cache
    assert cache is not None
    # fill the pool with pinned blocks through the index
    ids = sched.kv.pool.allocate(3)
    assert ids is not None
    assert cache.insert_prefix(list(range(12)), ids, pin=True).is_pinned
    seq = seq_of(list(range(50, 60)))
    sched.add(seq)
    plan = sched.schedule()
    assert plan.aborted == [seq] and seq.finish_reason == "abort"
    assert not sched.has_unfinished


# ---------------------------------------------------------------- schedule policies

import pytest

from prefixkv.engine.schedule_policy import AdmissionOrder


def cache_prefix(sched: Scheduler, tokens: list[int]) -> None:
    """Run ``tokens`` as a request to completion so its full blocks end up cached."""
    seq = seq_of(tokens, "warm")
    sched.add(seq)
    while seq.num_computed_tokens < len(tokens):
        run_step(sched, sched.schedule())
    sched.finish(seq)


def test_unknown_policy_is_refused() -> None:
    sched, _ = setup(num_blocks=8, block_size=4, budget=8)
    with pytest.raises(ValueError, match="schedule_policy must be one of fcfs, lpm, dfs-weight"):
        Scheduler(sched.kv, max_num_seqs=4, max_num_batched_tokens=8, clock=lambda: 0.0,
                  policy="sjf")


@pytest.mark.parametrize(("policy", "first"), [("fcfs", "cold"), ("lpm", "warm")])
def test_lpm_admits_the_cached_prefix_first(policy: str, first: str) -> None:
    sched, _ = setup(num_blocks=64, block_size=4, budget=20, max_seqs=1)
    sched.order = AdmissionOrder(policy, sched.kv.cache, 4)
    shared = list(range(100, 116))
    cache_prefix(sched, shared + [1])
    cold = seq_of(list(range(200, 220)), "cold")
    warm = seq_of(shared + [5, 6, 7, 8], "warm")
    sched.add(cold)
    sched.add(warm)
    plan = sched.schedule()
    assert [s.seq.request.request_id for s in plan.scheduled] == [first]


def test_dfs_weight_groups_shared_prefixes_heaviest_first() -> None:
    from collections import deque

    sched, _ = setup(num_blocks=64, block_size=4, budget=64)
    a, b = list(range(10, 18)), list(range(50, 58))
    seqs = {name: seq_of(prefix + [i, i + 1], name) for name, prefix, i in
            [("b1", b, 1), ("a1", a, 2), ("b2", b, 3), ("a2", a, 4), ("a3", a, 5), ("c", [9] * 8, 6)]}
    waiting = deque(seqs.values())
    AdmissionOrder("dfs-weight", sched.kv.cache, 4).reorder(waiting)
    assert [s.request.request_id for s in waiting] == ["a1", "a2", "a3", "b1", "b2", "c"]


def test_fairness_bound_and_preempted_sequences_go_first() -> None:
    from collections import deque

    sched, _ = setup(num_blocks=64, block_size=4, budget=64)
    shared = list(range(100, 116))
    cache_prefix(sched, shared + [1])
    cold = seq_of(list(range(200, 220)), "cold")
    warm = [seq_of(shared + [i, i], f"w{i}") for i in range(3)]
    order = AdmissionOrder("lpm", sched.kv.cache, 4, max_wait_rounds=2)
    waiting = deque([cold, *warm])
    heads = []
    for _ in range(3):
        order.reorder(waiting)
        heads.append(waiting[0].request.request_id)
    assert heads == ["w0", "w0", "cold"]  # passed over twice, then first
    late = seq_of(list(range(300, 320)), "late")
    order.note_preempted(late)
    waiting.append(late)
    order.reorder(waiting)
    assert [s.request.request_id for s in waiting][:2] == ["late", "cold"]
    for s in list(waiting):
        order.forget(s)
    assert not order._rounds and not order._preempted and not order._ticket


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_policies_never_change_greedy_outputs(make_llm, helpers, policy: str) -> None:
    from prefixkv.engine import SamplingParams

    systems = [helpers.tokens(s, 80) for s in range(3)]
    prompts = [systems[i % 3] + helpers.tokens(100 + i, 10 + i) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = make_llm(num_kv_blocks=40, max_num_batched_tokens=128).generate(prompts, params)
    llm = make_llm(num_kv_blocks=40, max_num_batched_tokens=128, schedule_policy=policy)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    helpers.assert_no_leak(llm)
