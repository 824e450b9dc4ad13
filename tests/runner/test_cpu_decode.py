"""The per-step C decode path (prefixkv/runner/cpu_decode.py): the same hidden states and K/V,
bit for bit, as the module path on every architecture it takes, and the module path wherever
it does not apply."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from prefixkv.models import cpu_gemv, cpu_ops
from prefixkv.runner import cpu_attention, cpu_decode
from prefixkv.runner.model_runner import ModelRunner, RunItem

needs_path = pytest.mark.skipif(
    not (cpu_gemv.ENABLED and cpu_ops.ENABLED and cpu_attention.ENABLED),
    reason="the C extensions are not built here (or are switched off)",
)


def _both_ways(runner: ModelRunner, steps: list[list[RunItem]], monkeypatch) -> None:
    """Run ``steps`` with the path on, then off, from the same pool contents; every step's
    hidden states and the whole pool afterwards must be equal bit for bit."""
    start = runner.kv_pool.kv.clone()
    path, taken = runner.cpu_decode, []
    assert path is not None
    real = path.run
    monkeypatch.setattr(path, "run", lambda *a: taken.append(real(*a)) or taken[-1])
    results = {}
    for on in (True, False):
        monkeypatch.setattr(cpu_decode, "ENABLED", on)
        runner.kv_pool.kv.copy_(start)
        with torch.inference_mode():
            hidden = [runner.hidden_states(items)[0].clone() for items in steps]
        results[on] = (hidden, runner.kv_pool.kv.clone())
    assert sum(h is not None for h in taken) == len(steps) - 1  # all but the first prefill
    (h_on, kv_on), (h_off, kv_off) = results[True], results[False]
    for a, b in zip(h_on, h_off, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    assert torch.equal(kv_on, kv_off)


def _steps(batch: int, prompt: int, decodes: int) -> list[list[RunItem]]:
    tables = [list(range(1 + 8 * b, 9 + 8 * b)) for b in range(batch)]
    prompts = [[(31 * i + 11 * b) % 250 + 3 for i in range(prompt)] for b in range(batch)]
    steps = [[RunItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)]]
    steps.append([RunItem([7 + b] * 5, prompt, t) for b, t in enumerate(tables)])  # short chunks
    for s in range(decodes):
        steps.append([RunItem([40 + b + s], prompt + 5 + s, t) for b, t in enumerate(tables)])
    return steps


@needs_path
@pytest.mark.parametrize("batch", [1, 3])
def test_the_demo_model_qwen3_qk_norms_bit_for_bit(batch, monkeypatch, gemv_layout):
    from prefixkv.models.demo import ensure_demo_model

    runner = ModelRunner(ensure_demo_model(), dtype="float32", num_kv_blocks=32)
    assert runner.cpu_decode is not None
    _both_ways(runner, _steps(batch, 40, 6), monkeypatch)


@needs_path
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_architectures_bit_for_bit(arch, make_hf_model, monkeypatch, gemv_layout):
    """Llama (llama3 RoPE), Qwen2 (q/k/v bias, tied output), Qwen3 (q/k norms); 32-wide heads."""
    overrides = {"hidden_size": 128, "intermediate_size": 256}
    path, _ = make_hf_model(arch, **overrides)
    runner = ModelRunner(path, dtype="float32", num_kv_blocks=32)
    assert runner.cpu_decode is not None
    _both_ways(runner, _steps(2, 33, 4), monkeypatch)


@needs_path
@pytest.mark.parametrize("arch", ["demo", "qwen2"])
def test_logits_of_its_steps_bit_for_bit(arch, make_hf_model, monkeypatch, gemv_layout):
    """``execute``'s logits through the path's own output matmul (an untied head; Qwen2's tied
    one) equal the module path's: every row of a decode batch, the last row of one chunk; a
    step of two chunks takes the module path's row gather."""
    from prefixkv.models.demo import ensure_demo_model

    if arch == "demo":
        path = ensure_demo_model()
    else:
        path, _ = make_hf_model(arch, hidden_size=128, intermediate_size=256)
    runner = ModelRunner(path, dtype="float32", num_kv_blocks=32)
    assert runner.cpu_decode is not None and runner.cpu_decode.output is not None
    steps = _steps(2, 33, 2) + [[RunItem([9] * 6, 40, list(range(1, 9)))]]
    start = runner.kv_pool.kv.clone()
    results = {}
    for on in (True, False):
        monkeypatch.setattr(cpu_decode, "ENABLED", on)
        runner.kv_pool.kv.copy_(start)
        results[on] = [runner.execute(items) for items in steps]
    for a, b in zip(results[True], results[False], strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b), (a - b).abs().max()
    assert [r.shape[0] for r in results[True]] == [2, 2, 2, 2, 1]


@needs_path
def test_steps_it_does_not_take(monkeypatch, gemv_layout):
    from prefixkv.models.demo import ensure_demo_model

    monkeypatch.setattr(cpu_decode, "ENABLED", True)
    runner = ModelRunner(ensure_demo_model(), dtype="float32", num_kv_blocks=64)
    path = runner.cpu_decode
    assert path is not None
    calls = []
    real = path.run

    def spy(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(path, "run", spy)
    table = list(range(1, 10))
    runner.execute([RunItem(list(range(3, 3 + cpu_gemv.MAX_ROWS + 1)), 0, table)])  # too many rows
    runner.execute([RunItem([5], cpu_gemv.MAX_ROWS + 1, table)])  # a decode: taken
    monkeypatch.setattr(cpu_attention, "DECODES", False)  # decodes on the torch path
    runner.execute([RunItem([6], cpu_gemv.MAX_ROWS + 2, table)])
    assert calls == [False, True, False]


def test_what_it_is_not_built_for(monkeypatch):
    from prefixkv.models.demo import ensure_demo_model

    assert ModelRunner(ensure_demo_model(), dtype="bfloat16", num_kv_blocks=8).cpu_decode is None
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    assert ModelRunner(ensure_demo_model(), dtype="float32", num_kv_blocks=8).cpu_decode is None


@needs_path
def test_a_weight_the_c_matmul_cannot_read_keeps_the_module_path(
    monkeypatch, gemv_layout
):
    from prefixkv.models import cpu_pack

    real = cpu_pack.cpu_gemv.readable
    seen = []

    def refuse_one(*args):
        seen.append(1)
        return (0, 0) if len(seen) == 3 else real(*args)

    monkeypatch.setattr(cpu_pack.cpu_gemv, "readable", refuse_one)
    from prefixkv.models.demo import ensure_demo_model

    assert ModelRunner(ensure_demo_model(), dtype="float32", num_kv_blocks=8).cpu_decode is None


def test_the_environment_switch_turns_the_path_off():
    code = "from prefixkv.runner import cpu_decode as c; print(c.ENABLED)"
    env = {**os.environ, "PREFIXKV_CPU_DECODE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["False"], out.stderr
