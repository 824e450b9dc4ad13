"""One engine of ``prefixkv.bench.engine_peers``, driven over stdin/stdout (JSON lines).

    python peer_worker.py ENGINE MODEL THREADS

ENGINE: ``prefixkv`` | ``prefixkv-q4`` (``quantization="gguf"``) | ``transformers`` (an HF directory) | ``llama.cpp`` (a GGUF file) |
``vllm`` (an HF directory). The file imports only the standard library at module level, so the
peers' venv runs it by path without prefixkv installed there. Each request line is
``{"prompts": [[ids]], "max_tokens": n, "reset": bool}``; the answer is
``{"seconds": wall time of the generate call, "tokens": [[ids]]}``, or ``{"error": text}``.
Greedy decoding, end-of-sequence ignored, so every engine does the same work. The weights' dtype
is ``$PREFIXKV_PEER_DTYPE`` (``float32`` by default, or ``bfloat16``; llama.cpp runs its GGUF's).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

Generate = Callable[[list[list[int]], int, bool], list[list[int]]]
DTYPE = os.environ.get("PREFIXKV_PEER_DTYPE", "float32")


def _prefixkv(model: str, threads: int, **settings: Any) -> Generate:
    from prefixkv.engine import LLM, SamplingParams

    llm = LLM(model, threads=threads, dtype=DTYPE, **settings)

    def run(prompts: list[list[int]], n: int, reset: bool) -> list[list[int]]:
        if reset:
            llm.reset_prefix_cache()
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]

    return run


def _transformers(model: str, threads: int) -> Generate:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, DTYPE))
    hf.eval()

    def run(prompts: list[list[int]], n: int, reset: bool) -> list[list[int]]:
        width = max(map(len, prompts))  # left padding, masked
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
        return [row[width:].tolist() for row in out]

    return run


def _llama_cpp(model: str, threads: int) -> Generate:
    from llama_cpp import Llama  # type: ignore[import-not-found]  # the peers' venv only

    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=4096,
                n_batch=512, verbose=False)

    def run(prompts: list[list[int]], n: int, reset: bool) -> list[list[int]]:
        outs = []
        for p in prompts:  # one sequence at a time (no batched decode in llama-cpp-python)
            if reset:
                llm.reset()
            toks: list[int] = []
            # reset=True is llama-cpp-python's prefix reuse: it keeps the longest common prefix
            # of the tokens it holds and evaluates the rest (reset=False appends the whole
            # prompt to the previous context instead)
            for tok in llm.generate(p, temp=0.0, top_k=1, reset=True):
                toks.append(int(tok))
                if len(toks) == n:
                    break
            outs.append(toks)
        return outs

    return run


def _vllm(model: str, threads: int) -> Generate:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=DTYPE, enable_prefix_caching=True, max_model_len=4096)

    def run(prompts: list[list[int]], n: int, reset: bool) -> list[list[int]]:
        if reset:
            llm.reset_prefix_cache()
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


ENGINES: dict[str, Callable[[str, int], Generate]] = {
    "prefixkv": _prefixkv,
    "prefixkv-q4": partial(_prefixkv, quantization="gguf"),  # the Q4_1 GGUF kept at 4 bits
    "transformers": _transformers,
    "llama.cpp": _llama_cpp,
    "llama.cpp-q4": _llama_cpp,
    "vllm": _vllm,
}


def main(argv: list[str]) -> int:
    """Serve generate requests for one engine until stdin closes."""
    engine, model, threads = argv[0], argv[1], int(argv[2])
    run = ENGINES[engine](model, threads)
    print(json.dumps({"ready": engine}), flush=True)
    for line in sys.stdin:
        req: dict[str, Any] = json.loads(line)
        try:
            t0 = time.perf_counter()
            toks = run(req["prompts"], int(req["max_tokens"]), bool(req.get("reset")))
            answer: dict[str, Any] = {"seconds": time.perf_counter() - t0, "tokens": toks}
        except Exception as exc:  # one failed request is reported, the worker goes on
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
