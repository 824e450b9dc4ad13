"""AsyncEngine: streaming, abort (explicit and by leaving the stream), admin calls, shutdown."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from prefixkv.engine import LLM, AsyncEngine, RequestOutput, SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(demo_model: Any) -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_args(demo_model, block_size=4, num_kv_blocks=96)
    yield eng
    eng.shutdown()


def no_leak(engine: AsyncEngine) -> None:
    def check(e: Any) -> tuple[int, int, bool]:
        cached = e.kv.cache.num_cached_blocks if e.kv.cache is not None else 0
        return e.kv.pool.num_free + cached, e.kv.num_blocks, e.has_unfinished_requests()

    total, blocks, busy = engine.call_sync(check)
    assert (total, busy) == (blocks, False)


def test_stream_yields_growing_text_matching_llm(engine: AsyncEngine, demo_model: Any) -> None:
    async def run() -> list[RequestOutput]:
        return [o async for o in engine.generate("stream me", LONG, request_id="s1")]

    outs = asyncio.run(run())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    texts = [o.outputs[0].text for o in outs]
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:]))
    assert "".join(o.outputs[0].delta_text for o in outs) == texts[-1]
    ids = [t for o in outs for t in o.outputs[0].delta_token_ids]
    assert ids == outs[-1].outputs[0].token_ids and len(ids) == 40
    ref = LLM(demo_model, block_size=4, num_kv_blocks=96).generate("stream me", LONG)[0]
    assert ref.outputs[0].token_ids == ids
    no_leak(engine)


def test_concurrent_streams_and_duplicate_id(engine: AsyncEngine) -> None:
    async def one(i: int) -> RequestOutput:
        last = None
        async for out in engine.generate(f"shared system prompt, user {i}", LONG):
            last = out
        assert last is not None
        return last

    async def run() -> list[RequestOutput]:
        stream = engine.generate("first", LONG, request_id="dup")
        await stream.__anext__()
        with pytest.raises(ValueError, match="dup"):
            await engine.generate("second", LONG, request_id="dup").__anext__()
        await stream.aclose()
        return await asyncio.gather(*(one(i) for i in range(6)))

    outs = asyncio.run(run())
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert len({o.request_id for o in outs}) == 6
    no_leak(engine)


def test_abort_and_disconnect_free_blocks(engine: AsyncEngine) -> None:
    async def run() -> tuple[str | None, int]:
        stream = engine.generate("abort me", SamplingParams(max_tokens=300, ignore_eos=True), request_id="a1")
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break  # like a client disconnect
        await stream.aclose()
        seen = 0
        reason = None
        async for out in engine.generate("abort me too", SamplingParams(max_tokens=300, ignore_eos=True), request_id="a2"):
            seen += 1
            if seen == 2:
                assert await engine.abort("a2") is True
            reason = out.outputs[0].finish_reason
        assert await engine.abort("a2") is False
        return reason, seen

    reason, seen = asyncio.run(run())
    assert reason == "abort" and seen >= 2
    no_leak(engine)


def test_errors_and_admin_calls(engine: AsyncEngine, helpers: Any) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate([1], SamplingParams(max_tokens=10**6)):
                pass
        prefix = helpers.tokens(21, 24)
        pinned = await engine.pin_prefix(prefix, description="sys")
        assert pinned.num_blocks == 6
        assert [p.token_ids for p in await engine.list_pinned()] == [prefix]
        stats = await engine.get_stats()
        assert stats.cache is not None and stats.cache.pinned_blocks == 6
        last = None
        async for last in engine.generate(prefix + [40, 41], SamplingParams(max_tokens=2)):
            pass
        assert last is not None and last.num_cached_tokens == 24
        assert await engine.unpin_prefix(prefix) is True
        assert await engine.reset_prefix_cache() is True
        assert (await engine.get_stats()).num_cached_blocks == 0

    asyncio.run(run())
    no_leak(engine)


def test_shutdown_stops_thread(demo_model: Any) -> None:
    eng = AsyncEngine.from_args(demo_model, num_kv_blocks=16)

    async def run() -> None:
        async for _ in eng.generate("x", SamplingParams(max_tokens=2)):
            pass
        eng.shutdown()
        assert not eng.is_running
        with pytest.raises(RuntimeError):
            async for _ in eng.generate("y", SamplingParams(max_tokens=2)):
                pass

    asyncio.run(run())
    eng.shutdown()  # idempotent


def test_streamed_deltas_never_show_a_stop_string(engine: AsyncEngine) -> None:
    async def collect(params: SamplingParams) -> list[RequestOutput]:
        return [o async for o in engine.generate("stop strings", params)]

    base = asyncio.run(collect(LONG))[-1].outputs[0].text
    stop = base[10:13]
    outs = asyncio.run(collect(SamplingParams(temperature=0.0, max_tokens=40, stop=stop)))
    final = outs[-1].outputs[0]
    assert final.text == base[: base.index(stop)] and final.stop_reason == stop
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text
    assert all(stop not in o.outputs[0].text for o in outs)


def test_max_tokens_none_runs_to_the_pool_limit(engine: AsyncEngine) -> None:
    prompt = engine.chat_prompt([{"role": "user", "content": "hi"}])

    async def run() -> RequestOutput:
        last = None
        async for out in engine.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True)):
            last = out
        assert last is not None
        return last

    out = asyncio.run(run())
    n = len(out.prompt_token_ids)
    # one sequence alone can fill the pool: 96 blocks of 4 tokens
    assert len(out.outputs[0].token_ids) == 96 * 4 - n + 1
    assert out.outputs[0].finish_reason == "length"
    no_leak(engine)


def test_a_dropped_engine_stops_its_thread_and_frees_the_model(
    demo_model: Any, helpers: Any
) -> None:
    """Without ``shutdown()``: the engine thread (which held the AsyncEngine) ran for the life
    of the process and kept the model and the KV pool alive."""
    before = set(threading.enumerate())
    eng = AsyncEngine.from_args(demo_model, block_size=4, num_kv_blocks=32)

    async def run() -> list[RequestOutput]:
        return [o async for o in eng.generate("hello", LONG)]

    assert asyncio.run(run())[-1].finished
    threads = helpers.new_threads(before)
    runner = weakref.ref(eng.engine.runner)
    del eng
    gc.collect()
    assert helpers.all_end(threads)
    gc.collect()
    assert runner() is None  # the model and its KV pool are freed
