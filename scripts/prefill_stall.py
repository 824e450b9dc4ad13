"""The longest wait of a decoding request while a long prompt prefills, by step budget.

Usage (from the repository root; alternate budgets, the machine's speed drifts):
    for b in 4096 2048 4096 2048; do python scripts/prefill_stall.py $b; done
A request decodes greedily on the demo model; after 5 of its steps a 4,000-token prompt
arrives; the gap between the decoding request's outputs over the next 12 steps is timed; the
median over three repetitions of the longest gap is printed. With ``max_num_batched_tokens``
at 4,096 the prompt's prefill is one step (the decode waits for all of it); at 2,048 two.
"""
import random
import statistics
import sys
import time

from prefixkv.engine.llm import LLM
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.models.demo import ensure_demo_model

budget = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
engine = LLM(ensure_demo_model(), block_size=16, max_num_batched_tokens=budget).engine
rng = random.Random(0)


def tokens(n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


worst = []
for rep in range(3):
    decoding = f"decode-{rep}"
    engine.add_request(tokens(32), SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                       request_id=decoding)
    for _ in range(5):
        engine.step()
    engine.add_request(tokens(4000), SamplingParams(temperature=0.0, max_tokens=1),
                       request_id=f"long-{rep}")
    last, gaps = time.perf_counter(), []
    for _ in range(12):
        outs = engine.step()
        now = time.perf_counter()
        if any(o.request_id == decoding for o in outs):
            gaps.append(now - last)
            last = now
    worst.append(max(gaps))
    while engine.has_unfinished_requests():
        engine.step()
print(f"budget {budget}: longest gap of the decoding request {statistics.median(worst) * 1e3:.0f} ms")
