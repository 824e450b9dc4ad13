"""LLM API: cached-token accounting, multi-turn reuse, isolation, pinning, errors, no leaks."""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv.cache import PinError
from prefixkv.engine import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize(
    ("index", "block_size", "expected"),
    [("radix", 16, 100), ("radix", 1, 100), ("hash", 16, 100), ("hash", 1, 100)],
)
def test_second_request_reports_cached_prefix(
    make_llm: Any, helpers: Any, index: str, block_size: int, expected: int
) -> None:
    llm = make_llm(index=index, block_size=block_size)
    prefix = helpers.tokens(1, 100)
    first = llm.generate(prefix + [33] + helpers.tokens(2, 19), GREEDY)[0]
    second = llm.generate(prefix + [34] + helpers.tokens(3, 19), GREEDY)[0]
    assert first.num_cached_tokens == 0
    # at block size 16: 6 full blocks + the 4 matching rows of block 6 copied (partial reuse)
    assert second.num_cached_tokens == expected
    assert second.metrics.first_token_time is not None
    assert second.ttft is not None and second.ttft >= 0
    helpers.assert_no_leak(llm)


@pytest.mark.parametrize(("index", "block_size"), [("radix", 16), ("hash", 16), ("radix", 1)])
def test_multi_turn_hits_generated_blocks(make_llm: Any, helpers: Any, index: str, block_size: int) -> None:
    llm = make_llm(index=index, block_size=block_size)
    turn1 = helpers.tokens(5, 50)
    out1 = llm.generate(turn1, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    history = turn1 + out1.outputs[0].token_ids  # the last output token never had its KV computed
    out2 = llm.generate(history + helpers.tokens(6, 10), GREEDY)[0]
    computed = len(history) - 1
    assert out2.num_cached_tokens >= computed // block_size * block_size
    assert out2.num_cached_tokens > len(turn1)  # generated tokens were reused too
    if block_size == 1:
        assert out2.num_cached_tokens == computed
    helpers.assert_no_leak(llm)


def test_results_in_input_order_with_prompt_forms(make_llm: Any) -> None:
    llm = make_llm()
    ids = llm.tokenizer.encode("hello there")
    outs = llm.generate(
        ["hello there", ids, {"prompt_token_ids": ids}, {"prompt": "hello there"}], GREEDY
    )
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    assert outs[0].prompt == "hello there" and outs[1].prompt is None
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert [o.request_id for o in outs] == sorted({o.request_id for o in outs}, key=[o.request_id for o in outs].index)
    single = llm.generate("hello there", GREEDY)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_impossible_requests_raise_at_submission(make_llm: Any, helpers: Any) -> None:
    llm = make_llm(block_size=16, num_kv_blocks=4)  # 64 tokens of KV
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate(helpers.tokens(0, 60), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=llm.engine.max_model_len))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([10**6], GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"text": "x"}, GREEDY)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY])
    # a bad prompt later in the batch leaves nothing queued
    with pytest.raises(ValueError):
        llm.generate(["fine", [10**6]], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    helpers.assert_no_leak(llm)
    # a request that fits exactly still runs
    out = llm.generate(helpers.tokens(0, 60), SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def test_cache_salt_isolates_tenants(make_llm: Any, helpers: Any) -> None:
    llm = make_llm()
    prompt = helpers.tokens(9, 64)
    assert llm.generate(prompt, GREEDY, cache_salt="a")[0].num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY, cache_salt="b")[0].num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY, cache_salt="a")[0].num_cached_tokens == 63  # 3 blocks + 15 rows
    helpers.assert_no_leak(llm)


def test_pinned_prefix_survives_pressure(make_llm: Any, helpers: Any) -> None:
    llm = make_llm(block_size=4, num_kv_blocks=24, max_pinned_blocks=8)
    system = helpers.tokens(11, 32)  # 8 blocks
    pinned = llm.pin_prefix(system, description="system")
    assert pinned.num_blocks == 8 and pinned.description == "system"
    assert [p.token_ids for p in llm.list_pinned()] == [system]
    for i in range(6):  # each needs ~10 blocks: evicts everything not pinned
        llm.generate(helpers.tokens(20 + i, 36), GREEDY)
    out = llm.generate(system + helpers.tokens(40, 5), GREEDY)[0]
    assert out.num_cached_tokens == 32
    assert llm.unpin_prefix(system) is True and llm.unpin_prefix(system) is False
    assert llm.list_pinned() == []
    helpers.assert_no_leak(llm)
    with pytest.raises(PinError):
        llm.pin_prefix([1, 2])  # shorter than a block


def test_request_blocked_by_pins_is_aborted_not_hung(make_llm: Any, helpers: Any) -> None:
    llm = make_llm(block_size=4, num_kv_blocks=8, max_pinned_blocks=6)
    llm.pin_prefix(helpers.tokens(12, 24))  # 6 of 8 blocks pinned
    out = llm.generate(helpers.tokens(13, 12), SamplingParams(max_tokens=4))[0]
    assert out.finished and out.outputs[0].finish_reason == "abort"
    helpers.assert_no_leak(llm)


def test_reset_prefix_cache_and_stats(make_llm: Any, helpers: Any) -> None:
    llm = make_llm()
    prompt = helpers.tokens(14, 40)
    llm.generate(prompt, GREEDY)
    stats = llm.get_stats()
    assert stats.num_cached_blocks == 2 and stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_kv_blocks
    assert stats.cache is not None and stats.cache.inserts > 0
    assert llm.reset_prefix_cache() is True
    assert llm.get_stats().num_cached_blocks == 0
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0


def test_chat_uses_template(make_llm: Any) -> None:
    llm = make_llm()
    conv = [{"role": "user", "content": "What is 2+2?"}]
    outs = llm.chat(conv, GREEDY)
    text = llm.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
    assert outs[0].prompt == text
    assert outs[0].prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "4"}]], GREEDY)
    assert len(two) == 2 and two[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chat_continues_the_final_message(make_llm: Any) -> None:
    # vLLM's continue_final_message: the prompt stops right after the caller's start of the
    # assistant reply ("prefill"), so the model continues it and the turn's own prefix is cached
    llm = make_llm()
    conv = [{"role": "user", "content": "Give JSON."}, {"role": "assistant", "content": '{"a": '}]
    out = llm.chat(conv, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt is not None and out.prompt.endswith('assistant\n{"a": ')
    closed = llm.chat(conv, GREEDY, add_generation_prompt=False)[0]
    assert closed.prompt is not None and closed.prompt.startswith(out.prompt) and len(closed.prompt) > len(out.prompt)
    # a key of chat_template_kwargs wins over the flag (vLLM's rule), so this is the same prompt
    same = llm.chat(conv, GREEDY, chat_template_kwargs={"add_generation_prompt": False, "continue_final_message": True})
    assert same[0].prompt_token_ids == out.prompt_token_ids
    for kwargs, match in [
        ({"continue_final_message": True}, "cannot both be true"),  # add_generation_prompt defaults to True
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": "no"}}, "chat_template_kwargs.add_generation_prompt"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.chat(conv, GREEDY, **kwargs)
    with pytest.raises(ValueError, match="final message with text"):
        llm.chat(conv + [{"role": "assistant", "content": ""}], GREEDY, add_generation_prompt=False,
                 continue_final_message=True)
    # the template's own variables can be overridden (bos_token was a TypeError)
    assert llm.chat(conv, GREEDY, chat_template_kwargs={"bos_token": "<s>"})[0].outputs[0].token_ids


def test_bad_engine_arguments_raise(make_llm: Any) -> None:
    for kwargs, name in [
        ({"index": "btree"}, "index"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"block_size": 0}, "block_size"),
    ]:
        with pytest.raises(ValueError, match=name):
            make_llm(num_kv_blocks=8, **kwargs)


@pytest.mark.parametrize("index", ["radix", "hash"])
def test_concurrent_prompts_compute_a_shared_prefix_once(make_llm: Any, helpers: Any, index: str) -> None:
    llm = make_llm(index=index)
    system = helpers.tokens(30, 64)
    prompts = [system + helpers.tokens(31 + i, 5) for i in range(16)]
    outs = llm.generate(prompts, GREEDY)  # all submitted together, cold cache
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:])
    alone = make_llm(index=index, enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    helpers.assert_no_leak(llm)


def test_hash_collisions_never_change_outputs_or_leak(make_llm, helpers, monkeypatch):
    """A (forced) hash collision stops caching at that block; outputs and accounting stay right."""
    from prefixkv.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = [helpers.tokens(7, 40) + helpers.tokens(i, 20) for i in range(3)]
    expected = [o.outputs[0].token_ids for o in
                make_llm(enable_prefix_caching=False).generate(prompts, params)]
    llm = make_llm(index="hash", hash_algo="builtin", block_size=16)
    cache = llm.engine.kv.cache
    real = cache._hasher
    # every block after the first collides with the first block's hash
    monkeypatch.setattr(cache, "_hasher", lambda parent, toks, extra: 1 if parent != cache._root(
        None) else real(parent, toks, extra))
    got = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    helpers.assert_no_leak(llm)


def test_threads_sharing_one_llm_each_get_their_own_outputs(make_llm: Any, helpers: Any) -> None:
    """A web app's worker threads calling ``generate`` on one ``LLM``: each call returns its
    own prompts' outputs, equal to the same prompts run alone (greedy), nothing leaks, and a
    thread whose call is refused does not disturb the others (before: KeyErrors, a corrupt
    block table, threads hung for good)."""
    import threading

    llm = make_llm()
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prefix = helpers.tokens(40, 48)
    prompts = [prefix + helpers.tokens(50 + i, 5 + i) for i in range(6)]
    alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p in prompts]
    llm.reset_prefix_cache()
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []
    refused: list[str] = []
    start = threading.Barrier(len(prompts) + 2)

    def worker(i: int) -> None:
        try:
            start.wait()
            for _ in range(3):
                outs = llm.generate([prompts[i], prompts[(i + 1) % len(prompts)]], sp)
                results.setdefault(i, []).extend(o.outputs[0].token_ids for o in outs)
        except BaseException as exc:  # collected: the assertion below names it
            errors.append(exc)

    def bad_caller() -> None:
        start.wait()
        for _ in range(5):
            try:
                llm.generate([prompts[0], [10**9]], sp)
            except ValueError as exc:
                refused.append(str(exc))
            llm.get_stats()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    threads.append(threading.Thread(target=bad_caller))
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join(60)
    assert not [t for t in threads if t.is_alive()]
    assert errors == []
    assert len(refused) == 5
    for i, got in results.items():
        want = [alone[i], alone[(i + 1) % len(prompts)]] * 3
        assert got == want, i
    assert len(results) == len(prompts)
    assert not llm.engine.has_unfinished_requests() and llm._parked == {}
    helpers.assert_no_leak(llm)


def test_an_llm_over_an_engine_built_elsewhere(make_llm: Any, helpers: Any) -> None:
    """``LLM.from_engine``: a second engine on the same runner (one model in memory), here
    without a prefix index; same greedy tokens, and it is as thread safe as any ``LLM``."""
    from prefixkv.engine import LLM, LLMEngine

    llm = make_llm()
    prompt = helpers.tokens(70, 40)
    cached = llm.generate(prompt, GREEDY)[0]
    llm.reset_prefix_cache()  # the second engine reuses the same pool's blocks
    off = LLM.from_engine(LLMEngine(llm.engine.runner, enable_prefix_caching=False))
    cold = off.generate(prompt, GREEDY)[0]
    assert off.get_cache_stats() is None
    assert cold.outputs[0].token_ids == cached.outputs[0].token_ids


def test_a_short_call_is_not_held_behind_a_long_one_in_another_thread(make_llm: Any) -> None:
    """Whoever holds the lock steps the engine for everyone: a 2-token request started while
    another thread runs a 600-token one returns first (its output parked, then collected)."""
    import threading
    import time

    llm = make_llm()
    order: list[str] = []
    started = threading.Event()

    def long_call() -> None:
        started.set()
        llm.generate([5] * 40, SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True))
        order.append("long")

    t = threading.Thread(target=long_call)
    t.start()
    started.wait()
    deadline = time.monotonic() + 30
    while not llm.get_stats().num_running and time.monotonic() < deadline:
        pass  # until the long request is in the engine
    llm.generate([7] * 40, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    order.append("short")
    t.join(60)
    assert order == ["short", "long"]


def test_a_waiter_interrupted_by_ctrl_c_gives_up_its_turn() -> None:
    # Ctrl-C reaches the main thread while it waits for the engine behind another thread: it
    # leaves with KeyboardInterrupt, and its ticket blocks no one after it (a thread that had
    # queued behind it gets the lock as soon as the holder lets go)
    import signal
    import threading
    import time

    from prefixkv.engine.llm import _TurnLock

    lock = _TurnLock()
    held, release, got = threading.Event(), threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            release.wait(10)

    def later() -> None:
        with lock:
            got.set()

    def interrupt_when_queued() -> None:
        deadline = time.monotonic() + 10
        while lock._next < 2 and time.monotonic() < deadline:  # the main thread took its ticket
            time.sleep(0.001)
        time.sleep(0.05)  # and waits on it
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)  # a real Ctrl-C

    h = threading.Thread(target=holder)
    h.start()
    assert held.wait(10)
    threading.Thread(target=interrupt_when_queued).start()
    interrupted = False
    try:
        with lock:
            pass
    except KeyboardInterrupt:
        interrupted = True
    assert interrupted
    w = threading.Thread(target=later)
    w.start()  # queued after the abandoned ticket
    time.sleep(0.05)
    assert not got.is_set()  # the holder still holds it
    release.set()
    assert got.wait(10)  # the abandoned ticket was skipped
    h.join(10)
    w.join(10)
    with lock:  # and the lock is free for the next caller
        pass
