"""oneDNN-packed CPU weights compute what F.linear computes; bf16 keeps cache on/off identical."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from prefixkv.models.cpu_pack import pack_weight, packed_linear, packing_available
from prefixkv.models.demo import ensure_demo_model
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
    plain = ModelRunner(path, num_kv_blocks=32, device="cpu")
    for m in plain.model.modules():  # back to F.linear everywhere
        if hasattr(m, "packed"):
            m.packed = None
    plain.model._logits_packed = None  # type: ignore[attr-defined]
    toks = [random.Random(0).randrange(32, 127) for _ in range(21)]
    for r in (runner, plain):
        r.execute([RunItem(toks[:20], 0, [0, 1])])
    got = runner.execute([RunItem(toks[20:], 20, [0, 1])])
    want = plain.execute([RunItem(toks[20:], 20, [0, 1])])
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)


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
