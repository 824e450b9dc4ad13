"""The ``precise`` policy over two real prefixkv workers publishing KV events on loopback.

The workers bind their event sockets on free ports (``tcp://127.0.0.1:*``) and the router finds
them through each worker's ``GET /kv_events``; then a repeated prompt goes to the worker that
really holds it, and an admin reset there empties the router's index for that worker.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from prefixkv.wire.kv_events import block_hashes
from prefixkv.router.app import WORKER_HEADER, RouterConfig, RouterServer
from prefixkv.bench.route.run import ready
from prefixkv.router.local import LAUNCHED_KV_EVENTS
from prefixkv.router.health import wait_until_healthy
from prefixkv.router.local import LocalWorkers
from prefixkv.router.precise import PrecisePolicy

WORKER_ARGS = ["--num-kv-blocks", "128", "--block-size", "8", "--log-level", "warning",
               "--kv-events-config", LAUNCHED_KV_EVENTS]


@pytest.fixture(scope="module")
def workers() -> Iterator[LocalWorkers]:
    with LocalWorkers(2, None, WORKER_ARGS) as lw:
        asyncio.run(ready(lw.urls, timeout=120))
        yield lw


@pytest.fixture(scope="module")
def router(workers: LocalWorkers) -> Iterator[RouterServer]:
    config = RouterConfig(worker_urls=tuple(workers.urls), policy="precise",
                          health_check_interval=0.5, health_check_timeout=2.0)
    with RouterServer(config) as server:
        yield server


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def complete(url: str, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_workers_announce_their_event_endpoints(workers: LocalWorkers) -> None:
    d = httpx.get(f"{workers.urls[0]}/kv_events").json()
    assert d["endpoint"].startswith("tcp://127.0.0.1:") and not d["endpoint"].endswith("*")
    assert d["replay_endpoint"].startswith("tcp://127.0.0.1:") and d["block_size"] == 8


def test_repeated_prompt_goes_to_the_worker_holding_it_and_reset_forgets_it(
    workers: LocalWorkers, router: RouterServer
) -> None:
    policy = router.router.policy
    assert isinstance(policy, PrecisePolicy)
    prompt = "The exact index knows which worker holds this prompt. " * 4
    first = complete(router.url, prompt)
    assert first.status_code == 200, first.text
    holder = first.headers[WORKER_HEADER]
    ids = httpx.post(f"{holder}/tokenize", json={"prompt": prompt}).json()["tokens"]
    hashes = block_hashes(ids, 8)
    # the worker's BlockStored events reach the router's index: every full prompt block
    wait_for(lambda: policy.index.match(hashes, workers.urls)[holder] >= len(hashes) - 1,
             "the holder's blocks in the index")
    other = next(u for u in workers.urls if u != holder)
    assert policy.index.match(hashes, workers.urls)[other] == 0
    for _ in range(3):
        again = complete(router.url, prompt)
        assert again.headers[WORKER_HEADER] == holder
        usage = again.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= (len(ids) - 1) // 8 * 8
    reasons = router.router.metrics.requests.collect()[0].samples
    assert any(s.labels["reason"] == "exact_hit" and s.value >= 3 for s in reasons)
    # an admin reset on the holder: AllBlocksCleared empties its part of the index
    assert httpx.post(f"{holder}/v1/cache/reset").status_code == 200
    wait_for(lambda: policy.index.match(hashes, workers.urls)[holder] == 0,
             "the reset forgotten")
    view = {w["url"]: w for w in httpx.get(f"{router.url}/workers").json()["workers"]}
    assert view[holder]["exact_blocks"] == 0 and view[holder]["events_live"] == 1
    assert view[holder]["event_gaps"] == 0


def test_chat_prompts_are_tokenized_by_a_worker_and_matched_exactly(
    workers: LocalWorkers, router: RouterServer
) -> None:
    policy = router.router.policy
    assert isinstance(policy, PrecisePolicy)
    messages = [{"role": "system", "content": "You route on real caches. " * 6},
                {"role": "user", "content": "Which worker holds this conversation?"}]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0.0}
    first = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=120)
    holder = first.headers[WORKER_HEADER]
    ids = httpx.post(f"{holder}/tokenize", json={"messages": messages}).json()["tokens"]
    hashes = block_hashes(ids, 8)
    wait_for(lambda: policy.index.match(hashes, workers.urls)[holder] >= len(hashes) - 1,
             "the chat's blocks in the index")
    second = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=120)
    assert second.headers[WORKER_HEADER] == holder
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_salted_prompt_goes_to_the_worker_holding_it_without_its_tokens_published(
    workers: LocalWorkers, router: RouterServer
) -> None:
    """Issue 40.7: a salted request's blocks are published as hashes only, and the router,
    re-hashing the prompt it proxies under the same salt, still finds the worker holding it."""
    policy = router.router.policy
    assert isinstance(policy, PrecisePolicy)
    url = workers.urls[1]
    prompt = "A tenant's private prompt, cached under its own salt only. " * 4
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0, "cache_salt": "tenant-7"}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
    ids = httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    salted = block_hashes(ids, 8, ("tenant-7", None))
    wait_for(lambda: policy.index.match(salted, workers.urls)[url] >= len(salted) - 1,
             "the salted blocks in the index")
    assert policy.index.match(block_hashes(ids, 8), workers.urls)[url] == 0  # not unsalted
    for _ in range(2):
        again = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
        assert again.headers[WORKER_HEADER] == url
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    metrics = httpx.get(f"{router.url}/metrics").text  # the stream's health, per worker
    assert f'prefixkv:router_kv_event_undecodable{{worker="{url}"}} 0.0' in metrics
    assert f'prefixkv:router_kv_event_batches{{worker="{url}"}}' in metrics


def test_a_restarted_worker_is_forgotten_and_followed_again(
    workers: LocalWorkers, router: RouterServer
) -> None:
    policy = router.router.policy
    assert isinstance(policy, PrecisePolicy)
    url = workers.urls[1]
    prompt = "Blocks cached before a restart are gone after it. " * 3
    assert complete(url, prompt).status_code == 200  # straight to the worker, past the router
    ids = httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    hashes = block_hashes(ids, 8)
    wait_for(lambda: policy.index.match(hashes, [url])[url] >= len(hashes) - 1,
             "traffic that bypassed the router is in its index too")
    old = httpx.get(f"{url}/kv_events").json()["endpoint"]
    workers.procs[1].kill()
    workers.procs[1].wait()
    wait_for(lambda: not router.router.workers[url].healthy, "the router saw it go")
    workers.restart(1)
    asyncio.run(_healthy(url))
    wait_for(lambda: router.router.workers[url].healthy, "back in rotation", timeout=60)
    assert policy.index.match(hashes, [url])[url] == 0  # its old blocks are forgotten
    assert httpx.get(f"{url}/kv_events").json()["endpoint"] != old  # a new port: rediscovered
    assert complete(url, prompt).status_code == 200
    wait_for(lambda: policy.index.match(hashes, [url])[url] >= len(hashes) - 1,
             "the new stream followed")


async def _healthy(url: str) -> None:
    async with httpx.AsyncClient() as client:
        await wait_until_healthy(client, [url], timeout=120)


def test_periodic_resets_follow_the_request_count(workers: LocalWorkers) -> None:
    from prefixkv.bench.route.disturb import PeriodicResets

    count = [0]
    with PeriodicResets(workers.urls, 3, count=lambda: count[0]) as resets:
        time.sleep(0.1)
        assert resets.resets == 0
        count[0] = 6  # two resets due: the workers in turn
        wait_for(lambda: resets.resets == 2, "two resets")
    with PeriodicResets(workers.urls, 0) as off:
        pass
    assert off.resets == 0


def test_a_worker_that_connects_out_publishes_to_the_address_the_router_binds() -> None:
    """vLLM's "connect" form: the worker's PUB connects to ``bind:ADDRESS``, the router binds."""
    from prefixkv.router.local import free_port

    events, replay = free_port(), free_port()
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://127.0.0.1:{events}",
                         "replay_endpoint": f"tcp://127.0.0.1:{replay}"})
    args = [*WORKER_ARGS[:-2], "--kv-events-config", config]
    with LocalWorkers(1, None, args) as lw:
        asyncio.run(ready(lw.urls, timeout=120))
        url = lw.urls[0]
        spec = f"bind:tcp://127.0.0.1:{events}|tcp://127.0.0.1:{replay}"
        rc = RouterConfig(worker_urls=(url,), policy="precise", kv_events=(spec,))
        with RouterServer(rc) as server:
            policy = server.router.policy
            assert isinstance(policy, PrecisePolicy)
            prompt = "Events flow from a worker that dials the router. " * 4
            assert complete(server.url, prompt).status_code == 200
            ids = httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()["tokens"]
            hashes = block_hashes(ids, 8)
            wait_for(lambda: policy.index.match(hashes, [url])[url] >= len(hashes) - 1,
                     "the connecting worker's blocks in the index")
            again = complete(server.url, prompt)
            assert again.status_code == 200
            view = httpx.get(f"{server.url}/workers").json()["workers"][0]
            assert view["events_live"] == 1 and view["event_gaps"] == 0
    with pytest.raises(ValueError, match="bind:"):
        RouterConfig(worker_urls=("http://a:1",), policy="precise", kv_events=("bind:a:1",))
