"""Logits processing in isolation: vLLM's penalty formulas, bias, bans, min_p, grammar masks."""

from __future__ import annotations

import math

import pytest
import torch

from prefixkv.runner.logits_processors import (
    RowProcessing,
    apply_grammar_mask,
    process_logits,
    token_logprobs,
)


def test_noop_rows_return_the_same_tensor() -> None:
    logits = torch.randn(2, 8)
    assert process_logits(logits, [None, RowProcessing()]) is logits


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    out = process_logits(logits, [RowProcessing(repetition=2.0, prompt_ids=[0], output_ids=[1])])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]
    assert logits.tolist() == [[2.0, -2.0, 2.0, -2.0]]  # input untouched


def test_frequency_presence_bias_and_bans() -> None:
    logits = torch.zeros(1, 5)
    row = RowProcessing(frequency=0.5, presence=1.0, output_ids=[1, 1, 2], bias=[(3, 2.0)], banned=[4])
    out = process_logits(logits, [row])[0].tolist()
    assert out[:4] == [0.0, -2.0, -1.5, 2.0] and out[4] == float("-inf")


def test_min_p_uses_the_temperature_scaled_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = process_logits(logits, [RowProcessing(min_p=0.35, temperature=1.0)])[0]
    assert torch.isinf(out).tolist() == [False, False, True, True]  # 0.15 < 0.35 * 0.5
    hot = process_logits(logits, [RowProcessing(min_p=0.35, temperature=2.0)])[0]
    # at T=2, p ~ sqrt(p): 0.15 -> ratio sqrt(0.3) = 0.55 >= 0.35 stays; 0.05 -> 0.32 goes
    assert torch.isinf(hot).tolist() == [False, False, False, True]
    greedy = process_logits(logits, [RowProcessing(min_p=0.9, temperature=0.0)])
    assert greedy is logits


def test_token_logprobs_ranks_and_top() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    found = token_logprobs(logits, [0, 2], [2, 0])
    lsm = torch.log_softmax(logits, -1)
    assert found[0].rank == 3 and found[0].logprob == pytest.approx(float(lsm[0, 0]))
    assert [t for t, _, _ in found[0].top] == [1, 2] and found[1].top == []
    assert found[1].rank == 1 and math.isclose(found[1].logprob, float(lsm[1, 2]), rel_tol=1e-6)


def test_grammar_mask_from_llguidance() -> None:
    llguidance = pytest.importorskip("llguidance")
    from prefixkv.models.demo import ensure_demo_model
    from prefixkv.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ensure_demo_model())
    ll = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=259, eos_token=[258])
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_regex("a[bc]"))
    logits = torch.zeros(2, 259)
    out = apply_grammar_mask(logits, [None, matcher])
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [ord("a")]
    matcher.consume_token(ord("a"))
    out = apply_grammar_mask(logits, [matcher, None])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [ord("b"), ord("c")]
