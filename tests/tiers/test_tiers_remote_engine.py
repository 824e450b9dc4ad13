"""The shared Valkey tier with two real engines and a real ``valkey-server``: a prompt
prefilled on worker A is a remote hit on worker B with token-identical output; a server killed
mid-run (or never there) degrades to recompute, never a failed request."""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv.engine import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def tier(llm: Any, name: str) -> Any:
    return next(t for t in llm.get_stats().tiers if t.tier == name)


def assert_no_leak(llm: Any) -> None:
    kv = llm.engine.kv
    assert kv.pool.num_free + kv.cache.num_cached_blocks == kv.num_blocks
    assert kv.cache.get_stats().locked_blocks == 0


@pytest.mark.parametrize("index,bs", [("radix", 16), ("hash", 4)])
def test_prefill_on_a_is_remote_hit_on_b(
    index: str, bs: int, valkey: Any, make_llm: Any, tokens: Any
) -> None:
    system = tokens(1, 64)
    prompts = [system + tokens(10 + i, 9 + i) for i in range(4)]
    ref = make_llm(enable_prefix_caching=False).generate(prompts, GREEDY)
    a = make_llm(index=index, block_size=bs, kv_remote=valkey.url)
    b = make_llm(index=index, block_size=bs, kv_remote=valkey.url)
    outs_a = a.generate(prompts, GREEDY)
    assert a.engine.kv.tiers.flush()
    assert tier(a, "remote").stored_blocks > 0
    outs_b = b.generate(prompts, GREEDY)
    want = [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].token_ids for o in outs_a] == want
    assert [o.outputs[0].token_ids for o in outs_b] == want
    remote = tier(b, "remote")
    first = outs_b[0]
    assert first.num_cached_tokens == (len(prompts[0]) - 1) // bs * bs  # all from Valkey
    assert remote.hits > 0 and remote.loaded_bytes > 0 and remote.load_seconds > 0
    assert remote.errors == 0
    assert_no_leak(a)
    assert_no_leak(b)


def test_server_killed_mid_run_degrades_to_recompute(
    valkey: Any, make_llm: Any, tokens: Any, caplog: Any
) -> None:
    prompts = [tokens(20 + i, 80) for i in range(6)]
    ref = [o.outputs[0].token_ids for o in make_llm(enable_prefix_caching=False).generate(prompts, GREEDY)]
    a = make_llm(kv_remote=valkey.url, kv_remote_timeout=0.2)
    a.generate(prompts[:3], GREEDY)
    assert a.engine.kv.tiers.flush()
    b = make_llm(kv_remote=valkey.url, kv_remote_timeout=0.2)
    assert b.generate(prompts[:1], GREEDY)[0].num_cached_tokens > 0  # the remote works
    valkey.kill()
    outs = b.generate(prompts, GREEDY)  # prompts 1-2 were on the remote, 3-5 never were
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.finished and o.error is None for o in outs)
    assert outs[1].num_cached_tokens == 0  # recomputed: the remote is gone
    remote = tier(b, "remote")
    assert remote.errors >= 1
    assert "unavailable" in caplog.text
    assert_no_leak(b)
    assert b.engine.kv.tiers.flush()  # writes while down are dropped, not stuck


def test_remote_never_up_still_serves(make_llm: Any, tokens: Any) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llm = make_llm(kv_remote=f"redis://127.0.0.1:{port}", kv_remote_timeout=0.1)
    outs = llm.generate([tokens(30, 50), tokens(31, 50)], GREEDY)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 4 for o in outs)
    assert tier(llm, "remote").errors >= 1


def test_lookup_says_where_a_prefix_is_cached(valkey: Any, make_llm: Any, tokens: Any, tmp_path: Any) -> None:
    """``lookup_prefix``: the pool's match, each lower tier's leading run (Valkey asked with
    EXISTS), and what a request would read: equal to what the request then reads."""
    prompt = tokens(3, 200)
    a = make_llm(block_size=16, kv_remote=valkey.url)
    a.generate([prompt], GREEDY)
    assert a.engine.kv.tiers.flush()
    found = a.engine.lookup_prefix(prompt)
    assert found == {"pool": 192, "remote": 0, "reusable": 192}  # whole blocks: 204 tokens ran
    b = make_llm(block_size=16, kv_remote=valkey.url, kv_offload_size=64, kv_disk_dir=str(tmp_path))
    before = b.engine.lookup_prefix(prompt)
    assert before == {"pool": 0, "host": 0, "disk": 0, "remote": 192, "reusable": 192}
    assert tier(b, "remote").hits == 0  # nothing was read
    out = b.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == before["reusable"]
    assert b.engine.lookup_prefix(prompt, cache_salt="other")["reusable"] == 0  # another tenant
    c = make_llm(block_size=16, kv_remote=valkey.url)
    assert c.engine.lookup_prefix(prompt)["remote"] == 192
    valkey.kill()
    assert c.engine.lookup_prefix(prompt) == {"pool": 0, "remote": 0, "reusable": 0}  # dead: a miss
