"""Engine speed beside its peers: prefixkv, transformers, llama.cpp and vLLM's CPU build.

    scripts/install-engine-peers.sh                  # once: peers into /tmp/engpeers/venv
    python -m prefixkv.bench.engine_peers [--rounds 5] [--threads 2] [--json peers.json]

Same weights and dtype for every engine: the catalog's SmolLM2-135M-Instruct GGUF (Q4_1),
dequantized once to float32 into an f32 GGUF (llama.cpp) and an HF directory (transformers,
vLLM); prefixkv loads the f32 GGUF. Each engine runs in its own worker process
(``peer_worker.py``; the peers in the venv's python), with ``--threads`` threads, and the rounds
interleave the engines, so background load hits all of them alike; medians are reported. The
engines' order rotates from round to round and each engine's turn starts after ``--settle``
idle seconds, so no engine always runs right after another's threads (OpenMP runtimes keep
spinning for a while after their work: libgomp by its spin count, Intel's by
``KMP_BLOCKTIME``).

Per round and engine: TTFT of a 2,030-token prompt on an empty cache (cold), TTFT of a
2,030-token prompt whose 2,000-token prefix was just computed (warm), prefill tokens/s
(2,030 / cold TTFT), decode tokens/s at batch 1 and 8 (``(t(65 tokens) - t(1 token))`` over
the 64 decoded tokens per sequence) on 16-token prompts, and at batch 8 on the cached
2,000-token prefix (8 requests, each with its own 16-token suffix: the shared-system-prompt
case; engines with a prefix cache only). A peer whose package is missing is listed as such.
``--dtype bfloat16`` casts the same weights to bf16 in prefixkv, transformers and vLLM (llama.cpp
has no bf16 GGUF here and is left out): a separate table, never mixed with the fp32 one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("peer_worker.py")
DEFAULT_VENV = Path(os.environ.get("PREFIXKV_PEERS_VENV", "/tmp/engpeers/venv"))
PREFIX, SUFFIX, DECODE = 2000, 30, 64
LABELS = {"prefixkv": "prefixkv fp32", "transformers": "transformers fp32",
          "llama.cpp": "llama.cpp f32", "vllm": "vLLM-cpu fp32",
          "prefixkv-q4": "prefixkv Q4_1 (int4)", "llama.cpp-q4": "llama.cpp Q4_1"}
"""``prefixkv-q4`` / ``llama.cpp-q4`` (opt-in via ``--engines``): the catalog's Q4_1 GGUF itself,
prefixkv with ``quantization="gguf"`` (4-bit weights, not the same weights as the fp32 rows)."""


def f32_gguf(src: Path, dst: Path) -> Path:
    """``src`` with every tensor dequantized to F32 (metadata copied); cached at ``dst``."""
    import gguf
    import numpy as np

    if dst.is_file():
        return dst
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst) + ".tmp", arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    writer.add_key_value("general.file_type", 0, gguf.GGUFValueType.UINT32)  # ALL_F32
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(dst) + ".tmp", dst)
    return dst


def hf_dir(src: Path, dst: Path) -> Path:
    """An fp32 Hugging Face directory of the GGUF ``src`` (transformers' GGUF loader)."""
    if (dst / "config.json").is_file():
        return dst
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw: dict[str, Any] = {"gguf_file": src.name}
    model = AutoModelForCausalLM.from_pretrained(src.parent, dtype=torch.float32, **kw)
    model.hf_quantizer = None  # type: ignore[assignment]  # dequantized: save plain fp32
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src.parent, **kw).save_pretrained(dst)
    return dst


class Worker:
    """One engine's worker process; :meth:`generate` is one timed request."""

    def __init__(self, engine: str, python: str, model: Path, threads: int,
                 dtype: str = "float32") -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND="nobind", PREFIXKV_PEER_DTYPE=dtype)
        self.engine = engine
        self.proc = subprocess.Popen([python, str(WORKER), engine, str(model), str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        ready = self._read()
        if "ready" not in ready:
            raise RuntimeError(f"{engine} worker did not start: {ready}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return dict(json.loads(line))
        return {"error": f"worker exited with {self.proc.wait()}"}

    def generate(self, prompts: list[list[int]], max_tokens: int, reset: bool) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens,
                                          "reset": reset}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise RuntimeError(f"{self.engine}: {answer['error']}")
        return float(answer["seconds"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def one_round(w: Worker, rng: random.Random, has_cache: bool) -> dict[str, float]:
    """The five figures of one engine in one round (fresh random prompts each round)."""
    def toks(n: int) -> list[int]:
        return [rng.randrange(300, 40000) for _ in range(n)]

    prefix = toks(PREFIX)
    cold = w.generate([prefix + toks(SUFFIX)], 1, reset=True)
    res = {"ttft_cold_s": cold, "prefill_tok_s": (PREFIX + SUFFIX) / cold}
    if has_cache:
        res["ttft_warm_s"] = w.generate([prefix + toks(SUFFIX)], 1, reset=False)
        # 8 requests on the cached prefix (new 16-token suffixes in each call, so both calls
        # compute the same amount of prompt): decode with 2,016+ keys per sequence
        t1 = w.generate([prefix + toks(16) for _ in range(8)], 1, reset=False)
        tn = w.generate([prefix + toks(16) for _ in range(8)], DECODE + 1, reset=False)
        res["decode_b8_prefix_tok_s"] = 8 * DECODE / max(tn - t1, 1e-9)
    for batch in (1, 8):
        prompts = [toks(16) for _ in range(batch)]
        t1 = w.generate(prompts, 1, reset=True)
        tn = w.generate(prompts, DECODE + 1, reset=True)
        res[f"decode_b{batch}_tok_s"] = batch * DECODE / max(tn - t1, 1e-9)
    return res


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved rounds and print the issue-16 table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--engines", default="prefixkv,transformers,llama.cpp,vllm")
    p.add_argument("--json", type=Path)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--settle", type=float, default=1.0,
                   help="idle seconds before each engine's turn in a round")
    args = p.parse_args(argv)
    from prefixkv.models.catalog import ensure_model

    src = ensure_model("smollm2-135m-instruct")
    gguf32 = f32_gguf(src, src.with_name(src.stem.replace("Q4_1", "F32") + ".gguf"))
    models = {"prefixkv": gguf32, "llama.cpp": gguf32, "prefixkv-q4": src, "llama.cpp-q4": src}
    peer_python = str(args.venv / "bin" / "python")
    workers: dict[str, Worker] = {}
    failed: dict[str, str] = {}
    for engine in args.engines.split(","):
        if args.dtype != "float32" and engine.startswith("llama.cpp"):
            failed[engine] = f"no {args.dtype} GGUF of these weights"
            continue
        python = sys.executable if engine in ("prefixkv", "prefixkv-q4", "transformers") else peer_python
        try:
            model = models.get(engine) or hf_dir(src, src.parent / "hf-f32")
            workers[engine] = Worker(engine, python, model, args.threads, args.dtype)
        except (OSError, RuntimeError) as exc:
            failed[engine] = str(exc)
    rng = random.Random(0)
    rows: dict[str, list[dict[str, float]]] = {e: [] for e in workers}
    med: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        seed = rng.randrange(1 << 30)
        turn = r % max(len(workers), 1)
        order = list(workers)[turn:] + list(workers)[:turn]  # rotates: no fixed neighbour
        for engine in order:  # same prompts for every engine in a round
            time.sleep(args.settle)
            rows[engine].append(one_round(workers[engine], random.Random(seed),
                                          engine != "transformers"))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        med = {e: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
               for e, runs in rows.items() if runs}
        if args.json:  # after every round: a long run on a loaded machine keeps what it has
            args.json.write_text(json.dumps({"rounds_done": r + 1, "medians": med,
                                             "failed": failed, "runs": rows}, indent=2))
    for w in workers.values():
        w.close()
    print_table(med, failed, args.threads, args.rounds, args.dtype)
    return 0


def print_table(med: dict[str, dict[str, float]], failed: dict[str, str], threads: int,
                rounds: int, dtype: str = "float32") -> None:
    """The markdown table (same weights, same dtype on every row)."""
    short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    print(f"SmolLM2-135M-Instruct, same weights (Q4_1 GGUF dequantized), {short}, {threads} "
          f"threads, {rounds} interleaved rounds, medians")
    metrics = [("TTFT, 2,030-token prompt cold (s)", "ttft_cold_s", "{:.3f}"),
               ("TTFT, 2,000-token prefix cached (s)", "ttft_warm_s", "{:.3f}"),
               ("prefill tokens/s", "prefill_tok_s", "{:.0f}"),
               ("decode tokens/s, batch 1", "decode_b1_tok_s", "{:.1f}"),
               ("decode tokens/s, batch 8", "decode_b8_tok_s", "{:.1f}"),
               ("decode tokens/s, batch 8 on the cached 2,000-token prefix",
                "decode_b8_prefix_tok_s", "{:.1f}")]
    print("| metric | " + " | ".join(LABELS[e].replace("fp32", short) for e in med) + " |")
    print("| --- |" + " ---: |" * len(med))
    for title, key, fmt in metrics:
        cells = [fmt.format(m[key]) if key in m else "no cache" for m in med.values()]
        print(f"| {title} | " + " | ".join(cells) + " |")
    for engine, why in failed.items():
        print(f"{LABELS.get(engine, engine)}: not run ({why})")


if __name__ == "__main__":
    sys.exit(main())
