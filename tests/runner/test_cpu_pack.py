"""oneDNN-packed CPU weights compute what F.linear computes; bf16 keeps cache on/off identical."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from prefixkv.models import llama
from prefixkv.models.cpu_pack import (
    SHAPE_CACHE_CAPACITY,
    SHAPE_CACHE_VARS,
    bound_shape_caches,
    pack_weight,
    packed_linear,
    packing_available,
)
from prefixkv.models.demo import ensure_demo_model
from prefixkv.models.loader import load_model
from prefixkv.runner.kv_transfer import model_fingerprint
from prefixkv.runner.model_runner import ModelRunner, RunItem

needs_pack = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)


@needs_pack
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, tol: float, rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    packed = pack_weight(weight, bias)
    assert packed is not None
    got = packed_linear(x, packed, bias).float()
    want = F.linear(x.float(), weight.float(), bias.float())
    assert got.shape == (rows, 96)
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()


def test_unsupported_weights_stay_unpacked() -> None:
    assert pack_weight(torch.randn(8, 4).half()) is None  # fp16: F.linear keeps it
    assert pack_weight(torch.randn(8)) is None  # not a matrix
    assert pack_weight(torch.empty(8, 4, device="meta")) is None
    assert not packing_available(torch.device("meta"), torch.float32)


@needs_pack
def test_runner_packs_every_matmul_and_logits_match_unpacked() -> None:
    path = ensure_demo_model()
    runner = ModelRunner(path, num_kv_blocks=32, device="cpu")
    cfg = runner.config
    linears = 4 * cfg.num_hidden_layers + 1  # qkv, o, gate_up, down per layer + output layer
    assert runner.packed_weights == linears
    plain = _unpacked_runner(path)
    toks = [random.Random(0).randrange(32, 127) for _ in range(21)]
    for r in (runner, plain):
        r.execute([RunItem(toks[:20], 0, [0, 1])])
    got = runner.execute([RunItem(toks[20:], 20, [0, 1])])
    want = plain.execute([RunItem(toks[20:], 20, [0, 1])])
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)


def _unpacked_runner(path: object) -> ModelRunner:
    """A runner whose weights all stay plain on ``F.linear`` (packing refused)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama, "pack_weight", lambda *a, **k: None)
        runner = ModelRunner(path, num_kv_blocks=32, device="cpu")  # type: ignore[arg-type]
    assert runner.packed_weights == 0
    return runner


@needs_pack
def test_packing_drops_the_plain_copies_and_keeps_greedy_tokens() -> None:
    """Packed layers hold their weight once (meta placeholder); the fingerprint is the one of
    the weights as loaded; fp32 greedy decoding is token-identical to the F.linear model."""
    path = ensure_demo_model()
    runner, plain = ModelRunner(path, num_kv_blocks=32, device="cpu"), _unpacked_runner(path)
    linears = [m for m in runner.model.modules() if isinstance(m, llama.Linear)]
    assert linears and all(m.packed is not None and m.weight.is_meta for m in linears)
    assert runner.model.pack_weights() == runner.packed_weights  # idempotent
    shapes = {k: (v.shape, v.dtype) for k, v in runner.model.state_dict().items()}
    assert shapes == {k: (v.shape, v.dtype) for k, v in plain.model.state_dict().items()}
    assert runner.fingerprint == plain.fingerprint == model_fingerprint(load_model(path))
    with pytest.raises(ValueError, match="weights packed"):
        model_fingerprint(runner.model)
    tokens: dict[int, list[int]] = {}
    for r in (runner, plain):
        toks = [random.Random(1).randrange(32, 127) for _ in range(9)]
        logits = r.execute([RunItem(toks, 0, [0, 1, 2])])
        for _ in range(24):
            toks.append(int(logits[0].argmax()))
            logits = r.execute([RunItem(toks[-1:], len(toks) - 1, [0, 1, 2])])
        tokens[id(r)] = toks
    assert tokens[id(runner)] == tokens[id(plain)]


_RSS_PROBE = """
import gc, json, os, torch
from prefixkv.models.config import ModelConfig
from prefixkv.models.llama import Linear, LlamaForCausalLM
def rss(): return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
cfg = ModelConfig("LlamaForCausalLM", 512, 1024, 4096, 2, 8, 2, 128, 1e-6, 1e4, 256, False,
                  False, False, False)
model = LlamaForCausalLM(cfg)
Linear(64, 64).pack()  # oneDNN's one-off start-up memory is not the weights'
with torch.no_grad():
    for p in model.parameters():
        p.normal_()
mat = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, Linear))
gc.collect(); before = rss()
packed = model.pack_weights(); gc.collect()
print(json.dumps({"packed": packed, "matmul_bytes": mat, "growth": rss() - before}))
"""


@needs_pack
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_packing_does_not_double_resident_weight_bytes() -> None:
    """Process RSS after packing grows by far less than the matmul weights (it grew by all of
    them while the plain copies stayed). A fixed malloc mmap threshold makes freed weights
    go back to the OS at once, so RSS sees the drop."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["packed"] == 4 * 2 + 1 and got["matmul_bytes"] > 100 << 20
    assert got["growth"] < 0.25 * got["matmul_bytes"], got


@needs_pack
def test_bf16_packed_logits_close_to_fp32() -> None:
    """bf16 is a dtype option: its logits track fp32's within bf16 rounding. (Greedy tokens with
    the cache on and off can differ in bf16: matmul rounding depends on the batch's row count,
    with or without packing; fp32 keeps them identical, see tests/engine.)"""
    path = ensure_demo_model()
    toks = [random.Random(2).randrange(32, 127) for _ in range(12)]
    logits = []
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(path, num_kv_blocks=8, device="cpu", dtype=dtype)
        assert runner.packed_weights > 0
        logits.append(runner.execute([RunItem(toks, 0, [0])])[0])
    scale = logits[0].abs().max().item()
    assert (logits[1] - logits[0]).abs().max().item() < 0.1 * scale


_SHAPES_PROBE = """
import ctypes, json, os
from prefixkv import LLM, SamplingParams
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
def in_use():
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
llm = LLM(enable_prefix_caching=False)
greedy = SamplingParams(temperature=0.0, max_tokens=1)
llm.generate([40 + i % 50 for i in range(64)], greedy)
before = in_use()
for n in range(40, 340, 3):  # 100 prompts, each prefilled in a step of a new size
    llm.generate([40 + (7 * i) % 150 for i in range(n)], greedy)
print(json.dumps({"grew": in_use() - before,
                  "env": {v: os.environ.get(v) for v in VARS}}))
""".replace("VARS", repr(SHAPE_CACHE_VARS))


@needs_pack
@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"),
                    reason="needs glibc's mallinfo2")
def test_memory_stays_bounded_across_new_step_sizes() -> None:
    """A server's prefill steps come in every size; each new one makes oneDNN create a matmul
    primitive (~0.5 MB) that its caches keep (1,024 each by default: 100 new sizes grew the heap
    by ~220 MB). With the caps the engine sets, malloc's in-use bytes grow by far less."""
    env = {k: v for k, v in os.environ.items() if k not in SHAPE_CACHE_VARS}
    out = subprocess.run([sys.executable, "-c", _SHAPES_PROBE], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["env"] == {v: str(SHAPE_CACHE_CAPACITY) for v in SHAPE_CACHE_VARS}
    assert got["grew"] < 80 << 20, got


def test_shape_cache_caps_leave_a_users_setting_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = SHAPE_CACHE_VARS
    monkeypatch.setenv(first, "16")
    monkeypatch.setenv(second, "x")  # recorded, so the test's end restores it
    monkeypatch.delenv(second)
    assert bound_shape_caches() == {first: "16", second: str(SHAPE_CACHE_CAPACITY)}
    assert os.environ[first] == "16"
