"""Offline: pin a system prompt so it survives pool pressure, and keep two tenants apart.

    python examples/system_prompt_and_tenants.py

Runs the built-in demo model on CPU (its text is meaningless; the cache behaviour is real).
Exits non-zero if a check fails.
"""

from __future__ import annotations

from prefixkv import LLM, SamplingParams

SYSTEM = "You are a support assistant for ACME routers. Be brief and precise. " * 6
params = SamplingParams(temperature=0, max_tokens=4)

# A small KV pool (96 blocks x 16 tokens), so unrelated traffic forces evictions; the pinned
# budget defaults to 20% of the pool, raised here to fit the 25-block system prompt.
llm = LLM(num_kv_blocks=96, block_size=16, max_pinned_blocks=32)
pinned = llm.pin_prefix(SYSTEM, description="support system prompt")
print(f"pinned {pinned.num_blocks} blocks: {pinned.description!r}")

# Unrelated long prompts fill the pool; unpinned blocks are evicted, the system prompt is not.
for i in range(6):
    llm.generate(f"Unrelated document {i}: " + "lorem ipsum dolor sit amet " * 20, params)

out = llm.generate(SYSTEM + "User: my router blinks red.", params)[0]
print(f"after pressure: {out.num_cached_tokens} of {len(out.prompt_token_ids)} prompt tokens cached")
assert out.num_cached_tokens >= pinned.num_blocks * 16, "the pinned system prompt was evicted"

# Tenants: the same prompt under different cache_salt values never shares cached blocks.
a1 = llm.generate(SYSTEM + "User: reset?", params, cache_salt="tenant-a")[0]
b1 = llm.generate(SYSTEM + "User: reset?", params, cache_salt="tenant-b")[0]
a2 = llm.generate(SYSTEM + "User: reset?", params, cache_salt="tenant-a")[0]
print(f"tenant-a first {a1.num_cached_tokens}, tenant-b {b1.num_cached_tokens}, "
      f"tenant-a again {a2.num_cached_tokens} cached tokens")
assert b1.num_cached_tokens == 0 and a2.num_cached_tokens > 0
print("stats:", llm.get_cache_stats())
