"""LoRA serving cost: prefill and decode tokens/s with 0, 1 and 4 adapters in a batch.

    python -m prefixkv.bench.lora [--model DIR] [--rank 16] [--rounds 3] [--json out.json]

Same run, same model, same dtype, the same prompts (token counts) on every row: a batch of
``--batch`` requests of ``--prompt-len`` random tokens, ``--decode-len`` greedy tokens each
(``ignore_eos``), run as *base* (no adapter), *1 adapter* (every request on the same one) and
*4 adapters* (request ``i`` on adapter ``i % 4``); rows interleaved per round, medians
reported. Prefill throughput is the batch's prompt tokens over the time to every first token;
decode throughput the generated tokens after the first over the rest of the time. The adapters
are random PEFT-format LoRAs (every q/k/v/o and gate/up/down projection, ``--rank``) written
to a temporary directory, so no PEFT install is needed. Prefix caching is on, but every
request's tokens are fresh (nothing is reused within a row).

Then **prefix hits per adapter**: a shared system prompt (``--prompt-len`` tokens) plus a
different question, sent twice per adapter and for the base model: each adapter's first
request computes the system prompt (its blocks are its own), its second reads it from the cache.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixkv.engine.llm import LLM

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(out: Path, llm: LLM, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA with random weights for ``llm``'s model in ``out``."""
    import torch
    from safetensors.torch import save_file

    c = llm.engine.runner.config
    q, kv, inter, h = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                       c.intermediate_size, c.hidden_size)
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for proj, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
        "bias": "none"}))
    return out


def run_row(llm: LLM, loras: list[str | None], args: argparse.Namespace,
            rng: random.Random) -> dict[str, float]:
    """One batch, stepped here: prefill tokens/s over the steps until every request has its
    first token, decode tokens/s over the steps after (wall time, or with ``--cpu-time`` this
    process's CPU time)."""
    from prefixkv.engine.sampling_params import SamplingParams

    engine = llm.engine
    clock = time.process_time if args.cpu_time else time.perf_counter
    params = SamplingParams(temperature=0, max_tokens=args.decode_len, ignore_eos=True)
    ids = {engine.add_request([rng.randrange(32, 127) for _ in range(args.prompt_len)], params,
                              lora_request=lora) for lora in loras}
    made: dict[str, int] = {}  # tokens so far per request (outputs are cumulative)
    spent = {"prefill": 0.0, "decode": 0.0}
    decoded = 0
    while engine.has_unfinished_requests():
        phase = "decode" if made.keys() == ids else "prefill"
        t0 = clock()
        outs = engine.step()
        spent[phase] += clock() - t0
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if phase == "decode":
                decoded += n - made[out.request_id]
            if n:
                made[out.request_id] = n
    return {"prefill_tok_s": len(loras) * args.prompt_len / max(spent["prefill"], 1e-9),
            "decode_tok_s": decoded / max(spent["decode"], 1e-9), "decode_tokens": decoded}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints the tables, writes ``--json``."""
    from prefixkv.engine.llm import LLM
    from prefixkv.engine.sampling_params import SamplingParams

    p = argparse.ArgumentParser(prog="python -m prefixkv.bench.lora", description=__doc__)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the demo)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--cpu-time", action="store_true",
                   help="tokens per CPU second of this process, not per wall second (steadier "
                        "on a shared machine; use with --threads 1)")
    args = p.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype, enable_lora=True, max_loras=4, max_lora_rank=args.rank,
              threads=args.threads, num_kv_blocks=max(64, 2 * args.batch * -(-(
                  args.prompt_len + args.decode_len) // 16)))
    rows: dict[str, list[dict[str, float]]] = {"base": [], "1 adapter": [], "4 adapters": []}
    with tempfile.TemporaryDirectory() as tmp, llm:
        assert llm.engine.lora is not None
        for i in range(4):
            llm.engine.lora.add(f"a{i}", write_random_adapter(Path(tmp) / f"a{i}", llm, args.rank, i))
        rng = random.Random(0)
        run_row(llm, [None] * 2, args, rng)  # warm up
        plans: dict[str, list[str | None]] = {
            "base": [None] * args.batch, "1 adapter": ["a0"] * args.batch,
            "4 adapters": [f"a{i % 4}" for i in range(args.batch)]}
        for _ in range(args.rounds):
            for name, plan in plans.items():
                rows[name].append(run_row(llm, plan, args, rng))
        system = [rng.randrange(32, 127) for _ in range(args.prompt_len)]
        hits: dict[str, list[int]] = {}
        for adapter in (None, "a0", "a1", "a2", "a3"):
            outs = [llm.generate(system + [rng.randrange(32, 127) for _ in range(8)],
                                 SamplingParams(max_tokens=1), lora_request=adapter)[0]
                    for _ in range(2)]
            hits[adapter or "base"] = [o.num_cached_tokens or 0 for o in outs]
    result: dict[str, Any] = {"args": vars(args), "rows": {}, "hits": hits}
    base = {k: statistics.median(r[k] for r in rows["base"]) for k in ("prefill_tok_s", "decode_tok_s")}
    print(f"batch {args.batch} x {args.prompt_len} prompt + {args.decode_len} decode tokens, "
          f"rank {args.rank}, {args.dtype}, medians of {args.rounds} rounds"
          + (", per CPU second" if args.cpu_time else ""))
    print(f"{'row':<12}{'prefill tok/s':>15}{'vs base':>9}{'decode tok/s':>15}{'vs base':>9}")
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in base}
        result["rows"][name] = med
        print(f"{name:<12}{med['prefill_tok_s']:>15.0f}{med['prefill_tok_s'] / base['prefill_tok_s']:>8.2f}x"
              f"{med['decode_tok_s']:>15.0f}{med['decode_tok_s'] / base['decode_tok_s']:>8.2f}x")
    print("cached prompt tokens (first, second request) per adapter on a shared system prompt:",
          ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in hits.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
