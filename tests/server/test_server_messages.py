"""Anthropic's Messages API through the official ``anthropic`` client against a live server: the
answer equals the chat completion of the same conversation, usage in Anthropic's terms (cache
reads of a shared system prompt), the event stream, stop sequences, tool use, counts, errors."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from server_live import BLOCK_SIZE, MODEL, LiveServer, unique_text

anthropic = pytest.importorskip("anthropic")

SYSTEM = "You are a careful assistant. " * 12
GREEDY = {"temperature": 0}  # (this SDK version has no temperature argument: sent as extra_body)
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                           "required": ["city"], "additionalProperties": False}}]


@pytest.fixture()
def claude(server: LiveServer) -> Any:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


def test_a_message_is_the_chat_answer_with_cache_reads(claude: Any, client: openai.OpenAI) -> None:
    question = unique_text("msg", 6)
    msg = claude.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": question}])
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.content[0].type == "text" and msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    u = msg.usage  # input_tokens: the prompt tokens computed; the rest were read from the cache
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens and u.cache_creation_input_tokens == 0
    other = claude.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": unique_text("msg2", 6)}])
    assert other.usage.cache_read_input_tokens >= len(SYSTEM.split()) - BLOCK_SIZE  # the shared system
    count = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": question}])
    assert count.input_tokens == chat.usage.prompt_tokens
    bare = [{"name": "f", "input_schema": {"type": "object"}}]  # a tool with no description
    asked = claude.messages.create(model=MODEL, max_tokens=1, tools=bare, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": question}])
    counted = claude.messages.count_tokens(model=MODEL, tools=bare, messages=[{"role": "user", "content": question}])
    assert counted.input_tokens == asked.usage.input_tokens + asked.usage.cache_read_input_tokens


def test_the_event_stream_builds_the_same_message(claude: Any, http: httpx.Client) -> None:
    body = {"model": MODEL, "max_tokens": 6, "system": SYSTEM, "temperature": 0,
            "messages": [{"role": "user", "content": unique_text("mstream", 6)}]}
    whole = claude.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    with claude.messages.stream(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0  # read once the first answer had cached it
    raw = http.post("/v1/messages", json={**body, "stream": True}).text
    kinds = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}


def test_stop_sequences_report_the_one_matched(claude: Any) -> None:
    messages = [{"role": "user", "content": unique_text("mstop", 6)}]
    full = claude.messages.create(model=MODEL, max_tokens=12, messages=messages, extra_body=GREEDY).content[0].text
    stop = full[3:6]
    cut = claude.messages.create(model=MODEL, max_tokens=12, messages=messages, stop_sequences=[stop],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == full[: full.index(stop)]


def test_tool_use_and_tool_results(claude: Any) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    forced = claude.messages.create(model=MODEL, max_tokens=64, messages=ask, tools=TOOLS,
                                    tool_choice={"type": "any"}, extra_body=GREEDY)
    use = forced.content[-1]
    assert forced.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert use.input["city"] in {"Paris", "Rome"}
    with claude.messages.stream(model=MODEL, max_tokens=64, messages=ask, tools=TOOLS, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == use.input
    answer = claude.messages.create(model=MODEL, max_tokens=4, tools=TOOLS, extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": [b.model_dump() for b in forced.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}])
    assert answer.content[0].type == "text" and answer.usage.cache_read_input_tokens > 0


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "messages[0].content[0]"),
    ({"max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024},
      "messages": [{"role": "user", "content": "x"}]}, 400, "thinking"),
    ({"max_tokens": 4, "model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"max_tokens": 4, "messages": []}, 400, "messages"),
    ({"max_tokens": 4, "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}],
      "messages": [{"role": "user", "content": "x"}]}, 400, "mcp_servers"),
    ({"max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "x"}]}, 400, "tools[0].input_schema"),
])
def test_errors_name_the_field(http: httpx.Client, body: dict[str, Any], status: int, param: str) -> None:
    r = http.post("/v1/messages", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()

