"""Use a running ``prefixkv serve`` through the official ``openai`` client.

Two chats share a long system prompt: the second reports the shared part as cached
(``usage.prompt_tokens_details.cached_tokens``) and arrives sooner. Then a streamed
completion with ``stream_options={"include_usage": True}``, and a tenant-isolated request
(``cache_salt``, a vLLM extension passed through ``extra_body``).

    prefixkv serve &                        # built-in demo model: its text is meaningless
    python examples/openai_client.py        # PREFIXKV_BASE_URL, PREFIXKV_API_KEY optional

Exits non-zero if a request fails or the second chat reports no cached tokens.
"""

from __future__ import annotations

import os
import sys
import time

import openai

base_url = os.environ.get("PREFIXKV_BASE_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1"
client = openai.OpenAI(base_url=base_url, api_key=os.environ.get("PREFIXKV_API_KEY", "EMPTY"))
model = client.models.list().data[0].id

system = "You are a helpful assistant. " + " ".join(f"Rule {i}: be brief." for i in range(60))


def ask(question: str) -> openai.types.chat.ChatCompletion:
    start = time.perf_counter()
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
    )
    usage = reply.usage
    assert usage is not None
    print(f"{question!r}: {usage.prompt_tokens} prompt tokens, "
          f"{usage.prompt_tokens_details.cached_tokens} cached, "
          f"{time.perf_counter() - start:.3f}s -> {reply.choices[0].message.content!r}")
    return reply


ask("What is the capital of France?")
second = ask("What is 2 + 2?")
assert second.usage is not None and second.usage.prompt_tokens_details is not None
if not second.usage.prompt_tokens_details.cached_tokens:
    sys.exit("expected the shared system prompt to be cached on the second request")

print("streamed: ", end="")
usage = None
for chunk in client.completions.create(model=model, prompt=system + " Say hi:", max_tokens=8,
                                       stream=True, stream_options={"include_usage": True}):
    if chunk.choices:
        print(chunk.choices[0].text, end="", flush=True)
    if chunk.usage is not None:
        usage = chunk.usage
print(f"\nusage: {usage}")

other = client.completions.create(model=model, prompt=system, max_tokens=1,
                                  extra_body={"cache_salt": "tenant-42"})
assert other.usage is not None and other.usage.prompt_tokens_details is not None
print(f"tenant-42 (own cache namespace): {other.usage.prompt_tokens_details.cached_tokens} "
      f"cached tokens")
