"""Sampler: greedy, temperature, top-k, top-p, per-request seeded streams."""

from __future__ import annotations

import pytest
import torch

from prefixkv.runner import SamplingRow, filter_logits, make_generator, sample


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [SamplingRow(), SamplingRow(temperature=0.0, top_k=1)]) == [1, 0]


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [True, True, False, False, False]
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.8))
    assert kept.tolist() == [True, True, True, False, False]  # 0.5+0.2 < 0.8 <= 0.85
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.1))
    assert kept.tolist() == [True, False, False, False, False]  # the top token always stays
    shuffled = logits[[3, 0, 4, 2, 1]]
    kept = torch.isfinite(filter_logits(shuffled, top_k=0, top_p=0.8))
    assert kept.tolist() == [False, True, False, True, True]


def test_samples_stay_inside_the_filter():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    gen = make_generator(1, "cpu")
    draws = {
        sample(logits, [SamplingRow(temperature=2.0, top_k=3, generator=gen)])[0]
        for _ in range(200)
    }
    assert draws <= top3 and len(draws) == 3


def test_seeded_rows_reproduce_regardless_of_batch_neighbours():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))

    def run(seed: int, batch: bool) -> list[int]:
        gen = make_generator(seed, "cpu")
        out = []
        for _ in range(20):
            if batch:
                rows = [
                    SamplingRow(temperature=1.0),
                    SamplingRow(temperature=1.0, generator=gen),
                    SamplingRow(temperature=0.7, top_p=0.9),
                ]
                out.append(sample(logits, rows)[1])
            else:
                out.append(sample(logits[1:2], [SamplingRow(temperature=1.0, generator=gen)])[0])
        return out

    assert run(7, batch=True) == run(7, batch=False)
    assert run(7, batch=False) != run(8, batch=False)
    assert make_generator(None, "cpu") is None


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        SamplingRow(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingRow(top_p=0.0)
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 5), [SamplingRow()])


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-30])
def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(top_p):
    # issue 9: {"top_p": 5e-324} filtered out every token and torch.multinomial raised,
    # which ended the engine thread
    logits = torch.tensor([[0.0, 4.0, 1.0], [2.0, 0.0, 1.0]])
    gen = make_generator(0, "cpu")
    rows = [SamplingRow(temperature=1.0, top_p=top_p, generator=gen) for _ in range(2)]
    assert sample(logits, rows) == [1, 0]


def test_a_collapsed_distribution_falls_back_to_the_mode_instead_of_raising():
    logits = torch.tensor([[0.0, 4.0, 1.0], [float("nan")] * 3])
    rows = [SamplingRow(temperature=1e-300), SamplingRow(temperature=1.0)]
    assert sample(logits, rows)[0] == 1
    assert len(sample(logits, rows)) == 2
