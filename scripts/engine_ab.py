"""Demo-model decode step and cold / warm TTFT of the tree on PYTHONPATH, for A/Bs across trees.

Usage (run the two trees alternately, several pairs; the machine's speed drifts between
minutes, so compare pairs, not runs far apart):
    git worktree add /tmp/oldtree <commit> && (cd /tmp/oldtree && python setup.py build_ext --inplace)
    for i in 1 2 3; do PYTHONPATH=/tmp/oldtree python scripts/engine_ab.py; PYTHONPATH=. python scripts/engine_ab.py; done
Prints: the tree, the median decode step (5 x 256 greedy tokens from a 32-token prompt) and the
medians of 15 cold / warm TTFTs (a 2,048-token prefix + 32 new tokens, max_tokens=1; warm: the
first request after the cold one), as ``prefixkv bench engine`` measures them. An optional
argument sets the engine's ``max_num_batched_tokens`` (default 4,096: the 2,080-token cold
prompt is one step; 2,048 makes it a 2,048-token step and a 32-token one).
"""
import random
import statistics
import sys
import time

import prefixkv
from prefixkv.engine.llm import LLM
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.models.demo import ensure_demo_model

budget = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
llm = LLM(ensure_demo_model(), block_size=16, max_num_batched_tokens=budget)
rng = random.Random(0)


def tokens(n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


prompt = tokens(32)
decode = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
llm.generate(prompt, decode)
steps = []
for _ in range(5):
    t0 = time.perf_counter()
    llm.generate(prompt, decode)
    steps.append((time.perf_counter() - t0) / 256 * 1e6)
prefix, first = tokens(2048), SamplingParams(temperature=0.0, max_tokens=1)
cold, warm = [], []
for _ in range(15):
    llm.reset_prefix_cache()
    cold.append((llm.generate(prefix + tokens(32), first)[0].ttft or 0.0) * 1e3)
    warm.append((llm.generate(prefix + tokens(32), first)[0].ttft or 0.0) * 1e3)
c, w = statistics.median(cold), statistics.median(warm)
tree = prefixkv.__file__.rsplit("/prefixkv/", 1)[0]
print(f"{tree} (budget {budget}): decode {statistics.median(steps):6.1f} us/step  cold {c:5.1f} ms  warm {w:5.2f} ms  {c / w:4.1f}x")
