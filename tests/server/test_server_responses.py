"""OpenAI's Responses API through the official ``openai`` client against a live server: the
answer equals the chat completion of the same conversation, ``previous_response_id`` continues
a stored conversation from the prefix cache, the event stream, function calls, errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_live import BLOCK_SIZE, MODEL, unique_text

SYSTEM = "You answer briefly. " * 12


def chat_text(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, str]:
    r = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                       max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def test_a_response_is_the_chat_answer_and_continues_from_the_cache(client: openai.OpenAI) -> None:
    question = unique_text("resp", 6)
    first = client.responses.create(model=MODEL, input=question, instructions=SYSTEM,
                                    temperature=0, max_output_tokens=8)
    text, finish = chat_text(client, [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": question}], 8)
    assert first.object == "response" and first.model == MODEL and first.output_text == text
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    assert first.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert first.incomplete_details is not None and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage is not None and first.usage.output_tokens <= 8
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    # the next turn: the stored conversation plus the new input, the earlier turn from the cache
    follow = unique_text("again", 4)
    second = client.responses.create(model=MODEL, input=follow, instructions=SYSTEM,
                                     previous_response_id=first.id, temperature=0, max_output_tokens=8)
    want, _ = chat_text(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
                                 {"role": "assistant", "content": text}, {"role": "user", "content": follow}], 8)
    assert second.output_text == want and second.previous_response_id == first.id
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - BLOCK_SIZE
    assert client.responses.retrieve(first.id).output_text == text
    items = client.responses.input_items.list(second.id)  # the SDK's paged list
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", follow)]
    raw = client.responses.input_items.list(first.id, order="asc", limit=1)
    assert raw.data[0].content[0].text == question and raw.has_more is False
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert gone.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_the_event_stream_builds_the_same_response(client: openai.OpenAI, http: httpx.Client) -> None:
    question = unique_text("stream", 6)
    whole = client.responses.create(model=MODEL, input=question, temperature=0, max_output_tokens=6,
                                    store=False)
    events = list(client.responses.create(model=MODEL, input=question, temperature=0,
                                          max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", last]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text  # type: ignore[union-attr]
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):  # store=False: nothing kept
        client.responses.retrieve(whole.id)
    raw = http.post("/v1/responses", json={"model": MODEL, "input": question, "stream": True,
                                           "max_output_tokens": 2}).text
    assert raw.startswith("event: response.created\ndata: {")  # named SSE events, no [DONE]
    assert "[DONE]" not in raw


def test_function_calls_and_their_outputs_round_trip(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
              "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                             "required": ["city"], "additionalProperties": False}}]
    call = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools,  # type: ignore[arg-type]
                                   tool_choice="required", temperature=0, max_output_tokens=64)
    item = call.output[0]
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments)["city"] in {"Paris", "Rome"}
    streamed = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools,  # type: ignore[arg-type]
                                            tool_choice="required", temperature=0, max_output_tokens=64,
                                            stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == item.arguments
    answer = client.responses.create(
        model=MODEL, previous_response_id=call.id, tools=tools, temperature=0,  # type: ignore[arg-type]
        max_output_tokens=4, input=[{"type": "function_call_output", "call_id": item.call_id,
                                     "output": '{"temp_c": 21}'}])
    fed = client.responses.input_items.list(answer.id).data
    assert fed[0].type == "function_call_output" and fed[0].call_id == item.call_id
    assert answer.output[0].type == "message" and answer.usage is not None
    assert answer.usage.input_tokens > call.usage.input_tokens  # type: ignore[union-attr]


def test_structured_text_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="A number?", temperature=0, max_output_tokens=64,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["n"], int)
    assert r.text.format.type == "json_schema"  # type: ignore[union-attr]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"input": "x", "conversation": "conv_1"}, 400, "conversation"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, None),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, 400, "temperature"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "x", "model": "nope"}, 404, "model"),
    ({"input": [{"role": "user"}]}, 400, None),
    ({}, 400, None),
])
def test_errors_name_the_field(http: httpx.Client, body: dict[str, object], status: int,
                               param: str | None) -> None:
    r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.json()


def test_chat_errors_name_the_responses_field() -> None:
    from prefixkv.server.errors import APIError
    from prefixkv.server.openai.responses import chat_error

    assert chat_error(APIError("x", param="messages[2].content")).param == "input"
    assert chat_error(APIError("x", param="max_tokens")).param == "max_output_tokens"
    assert chat_error(APIError("x", param="response_format.json_schema")).param == "text.format"
    assert chat_error(APIError("x", param="seed")).param == "seed"  # no Responses counterpart


def test_input_items_page_through_a_stored_response(http: httpx.Client) -> None:
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
             {"role": "user", "content": unique_text("items", 3)}]
    rid = http.post("/v1/responses", json={"model": MODEL, "input": turns, "max_output_tokens": 1}).json()["id"]
    page = http.get(f"/v1/responses/{rid}/input_items", params={"limit": 2, "order": "asc"}).json()
    assert [i["role"] for i in page["data"]] == ["system", "user"] and page["has_more"] is True
    rest = http.get(f"/v1/responses/{rid}/input_items",
                    params={"order": "asc", "after": page["last_id"]}).json()
    assert [i["role"] for i in rest["data"]] == ["assistant", "user"] and rest["has_more"] is False
    assert rest["data"][0]["content"][0]["type"] == "output_text"
    newest = http.get(f"/v1/responses/{rid}/input_items", params={"limit": 1}).json()  # desc
    assert newest["data"][0]["id"] == rest["last_id"]
    assert http.get(f"/v1/responses/{rid}/input_items", params={"after": "msg_nope"}).status_code == 404
    assert http.get(f"/v1/responses/{rid}/input_items", params={"limit": 0}).status_code == 400
