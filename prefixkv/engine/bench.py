"""Engine benchmark: TTFT cold vs warm, decode throughput vs ``transformers``, seed 003's demo.

    python -m prefixkv.engine.bench [--json engine_bench.json] [--model DIR]

1. **TTFT**: a 2,048-token shared prefix + a 32-token suffix, ``max_tokens=1``. *Cold* runs
   on an empty cache (reset before each), *warm* reuses the prefix (a different suffix each
   time). Target: cold / warm >= 20x (prefill cost follows uncached tokens).
2. **Decode**: greedy tokens per second, ours vs ``transformers``' ``generate`` on the same
   model directory (its ``Qwen3ForCausalLM``), same process. Target: ratio >= 1.0.
3. **Seed 003's demo**: the long markdown table and two questions; the second is faster.

With no ``--model`` the built-in demo model is used: its text is meaningless (random weights),
only the timings matter. Medians over ``--repeats`` runs. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixkv.engine.llm import LLM
from prefixkv.engine.sampling_params import SamplingParams

TABLE_PROMPT = (
    "You are a helpful assistant in recognizes the content of tables in markdown format. "
    "Here is a table as follows.\n# Table\n"
    "| ID  | Name          | Age | Occupation    | Country       | Email                  "
    "| Phone Number   | Address                       |\n"
    "|-----|---------------|-----|---------------|---------------|------------------------"
    "|----------------|------------------------------|\n"
)
_PEOPLE = [
    ("John Doe", 29, "Engineer", "USA"), ("Jane Smith", 34, "Doctor", "Canada"),
    ("Alice Johnson", 27, "Teacher", "UK"), ("Bob Brown", 45, "Artist", "Australia"),
    ("Carol White", 31, "Scientist", "New Zealand"), ("Dave Green", 28, "Lawyer", "Ireland"),
    ("Emma Black", 40, "Musician", "USA"), ("Frank Blue", 37, "Chef", "Canada"),
    ("Grace Yellow", 50, "Engineer", "UK"), ("Henry Violet", 32, "Artist", "Australia"),
    ("Irene Orange", 26, "Scientist", "New Zealand"), ("Jack Indigo", 38, "Teacher", "Ireland"),
    ("Karen Red", 41, "Lawyer", "USA"), ("Leo Brown", 30, "Chef", "Canada"),
    ("Mia Green", 33, "Musician", "UK"), ("Noah Yellow", 29, "Doctor", "Australia"),
    ("Olivia Blue", 35, "Engineer", "New Zealand"), ("Peter Black", 42, "Artist", "Ireland"),
    ("Quinn White", 28, "Scientist", "USA"), ("Rachel Red", 31, "Teacher", "Canada"),
    ("Steve Green", 44, "Lawyer", "UK"), ("Tina Blue", 36, "Musician", "Australia"),
    ("Umar Black", 39, "Chef", "New Zealand"), ("Victor Yellow", 43, "Engineer", "Ireland"),
    ("Wendy Orange", 27, "Artist", "USA"), ("Xavier Green", 34, "Scientist", "Canada"),
    ("Yara Red", 41, "Teacher", "UK"), ("Zack Blue", 30, "Lawyer", "Australia"),
    ("Amy White", 33, "Musician", "New Zealand"), ("Ben Black", 38, "Chef", "Ireland"),
]


def table_prompt(rows: int = len(_PEOPLE)) -> str:
    """Seed 003's table prompt with its first ``rows`` rows (addresses use one pattern)."""
    return TABLE_PROMPT + "".join(
        f"| {i:<3} | {name:<13} | {age:<3} | {job:<13} | {country:<13} "
        f"| {name.split()[0].lower()}.{name.split()[1][0].lower()}@example.com | 555-{1000 + i:04d} "
        f"| {100 + i} Main St                  |\n"
        for i, (name, age, job, country) in enumerate(_PEOPLE[:rows], start=1)
    )


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


def bench_ttft(llm: LLM, prefix_len: int, suffix_len: int, repeats: int) -> dict[str, Any]:
    """Median TTFT of a cold (empty cache) and a warm (cached prefix) request."""
    rng = random.Random(0)
    prefix = _tokens(rng, prefix_len)
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(_tokens(rng, 64), sp)  # warm up kernels, not the cache
    cold, warm, cached = [], [], 0
    for _ in range(repeats):
        llm.reset_prefix_cache()
        out = llm.generate(prefix + _tokens(rng, suffix_len), sp)[0]
        cold.append(out.ttft or 0.0)
        out = llm.generate(prefix + _tokens(rng, suffix_len), sp)[0]
        warm.append(out.ttft or 0.0)
        cached = out.num_cached_tokens
    c, w = statistics.median(cold), statistics.median(warm)
    return {
        "prompt_tokens": prefix_len + suffix_len,
        "cached_tokens_warm": cached,
        "ttft_cold_s": c,
        "ttft_warm_s": w,
        "speedup": c / w if w > 0 else float("inf"),
    }


def bench_decode(llm: LLM, model_dir: Path, new_tokens: int, repeats: int, with_hf: bool) -> dict[str, Any]:
    """Greedy decode tokens/s (one 32-token prompt): ours vs ``transformers`` ``generate``."""
    prompt = _tokens(random.Random(1), 32)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    ours = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate(prompt, sp)[0]
        ours.append(len(out.outputs[0].token_ids) / (time.perf_counter() - t0))
    result: dict[str, Any] = {"new_tokens": new_tokens, "ours_tok_s": statistics.median(ours)}
    if not with_hf:
        return result
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    ids = torch.tensor([prompt])
    kw: dict[str, Any] = {
        "do_sample": False, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "pad_token_id": 0,
    }
    hf = []
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        for _ in range(repeats):
            t0 = time.perf_counter()
            gen = model.generate(ids, **kw)
            hf.append((gen.shape[1] - ids.shape[1]) / (time.perf_counter() - t0))
            hf_ids = gen[0, ids.shape[1] :].tolist()
    result["hf_tok_s"] = statistics.median(hf)
    result["ratio"] = result["ours_tok_s"] / result["hf_tok_s"]
    result["same_tokens_as_hf"] = hf_ids == out.outputs[0].token_ids
    return result


def bench_table_demo(llm: LLM, max_tokens: int, rows: int = len(_PEOPLE)) -> dict[str, Any]:
    """Seed 003: two questions over the same long table; the second reuses the table's KV."""
    long_prompt = table_prompt(rows)
    llm.reset_prefix_cache()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    runs: list[dict[str, Any]] = []
    for name in ("John Doe", "Zack Blue"):
        prompt = long_prompt + f"Question: what is the age of {name}? Your answer: The age of {name} is "
        t0 = time.perf_counter()
        out = llm.generate(prompt, sp)[0]
        runs.append(
            {
                "question": name,
                "prompt_tokens": len(out.prompt_token_ids),
                "cached_tokens": out.num_cached_tokens,
                "ttft_s": out.ttft,
                "generation_time_s": time.perf_counter() - t0,
                "output_tokens": len(out.outputs[0].token_ids),
                "text": out.outputs[0].text,
            }
        )
    return {"runs": runs, "speedup": runs[0]["generation_time_s"] / runs[1]["generation_time_s"]}


def _print_table(res: dict[str, Any]) -> None:
    t, d, s = res["ttft"], res["decode"], res["table_demo"]
    rows = [
        ("TTFT cold (2,048+32 tok)", f"{t['ttft_cold_s'] * 1000:.1f} ms", ""),
        ("TTFT warm (prefix cached)", f"{t['ttft_warm_s'] * 1000:.1f} ms", f"cached {t['cached_tokens_warm']}"),
        ("TTFT speedup", f"{t['speedup']:.1f}x", "target >= 20x"),
        ("decode, ours", f"{d['ours_tok_s']:.1f} tok/s", f"{d['new_tokens']} tokens, batch 1"),
    ]
    if "hf_tok_s" in d:
        rows.append(("decode, transformers", f"{d['hf_tok_s']:.1f} tok/s", "generate()"))
        rows.append(("decode ratio", f"{d['ratio']:.2f}x", f"target >= 1.0; same tokens: {d['same_tokens_as_hf']}"))
    for r in s["runs"]:
        rows.append(
            (f"seed 003: {r['question']}", f"{r['generation_time_s'] * 1000:.0f} ms",
             f"TTFT {r['ttft_s'] * 1000:.0f} ms, cached {r['cached_tokens']}/{r['prompt_tokens']}")
        )
    rows.append(("seed 003 speedup", f"{s['speedup']:.1f}x", "second question"))
    width = max(len(r[0]) for r in rows)
    print(f"prefixkv engine benchmark ({res['device']}, block_size {res['block_size']}; demo text is meaningless)")
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>14}  {note}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the three benchmarks; print a table and write JSON (``--json``)."""
    ap = argparse.ArgumentParser(prog="prefixkv-engine-bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--index", default="radix", choices=("radix", "hash"))
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--table-max-tokens", type=int, default=100)
    ap.add_argument("--table-rows", type=int, default=len(_PEOPLE), help="rows of seed 003's table")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--json", default="engine_bench.json", help="where to write the results")
    args = ap.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.model is None:
        from prefixkv.models.demo import ensure_demo_model

        model_dir = ensure_demo_model()
    else:
        model_dir = Path(args.model)
    llm = LLM(model_dir, block_size=args.block_size, index=args.index)
    res: dict[str, Any] = {
        "model": str(model_dir),
        "device": str(llm.engine.runner.device),
        "block_size": args.block_size,
        "index": args.index,
        "threads": args.threads,
    }
    res["ttft"] = bench_ttft(llm, args.prefix_len, args.suffix_len, args.repeats)
    res["decode"] = bench_decode(llm, model_dir, args.decode_tokens, args.repeats, not args.no_hf)
    res["table_demo"] = bench_table_demo(llm, args.table_max_tokens, args.table_rows)
    _print_table(res)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
