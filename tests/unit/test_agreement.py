"""Agreement metrics: neutral values when logprobs agree, hand-computed values otherwise, masking."""

from __future__ import annotations

import math

import pytest
import torch

from launcher.driver.agreement import agreement_metrics, gen_kl_error, token_mult_prob_error


def test_identical_logprobs_are_neutral():
    lp = torch.log(torch.rand(3, 7, generator=torch.Generator().manual_seed(0)))
    mask = torch.ones(3, 7)
    assert agreement_metrics(lp, lp.clone(), mask) == {"token_mult_prob_error": 1.0, "gen_kl_error": 0.0}


def test_hand_computed_values_and_mask():
    gen = torch.tensor([[0.0, -1.0, -2.0, -9.0]])
    train = torch.tensor([[0.0, -1.5, -1.0, float("-inf")]])  # last position is padding
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])                # position 0 is the prompt
    d = [0.5, 1.0]                                               # |gen - train| on masked tokens
    assert token_mult_prob_error(gen, train, mask) == pytest.approx(sum(math.exp(x) for x in d) / 2, rel=1e-12)
    logr = [-0.5, 1.0]                                           # train - gen
    want = sum(math.exp(x) - 1 - x for x in logr) / 2
    assert gen_kl_error(gen, train, mask) == pytest.approx(want, rel=1e-12)


def test_token_mean_not_sequence_mean():
    gen = torch.zeros(2, 4)
    train = torch.tensor([[0.0, 0.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    # 4 tokens: three agree, one is off by 1 -> (3 + e) / 4 (a sequence mean would be (1 + e) / 2)
    assert token_mult_prob_error(gen, train, mask) == pytest.approx((3 + math.e) / 4)


def test_small_disagreement_is_small_kl():
    gen = torch.full((1, 10), -2.0)
    train = gen + 1e-3
    assert 0 < gen_kl_error(gen, train, torch.ones(1, 10)) < 1e-6 < token_mult_prob_error(gen, train, torch.ones(1, 10)) - 1


def test_empty_mask_is_nan_and_shape_mismatch_raises():
    z = torch.zeros(2, 3)
    assert math.isnan(gen_kl_error(z, z, torch.zeros(2, 3)))
    with pytest.raises(ValueError, match="shapes differ"):
        token_mult_prob_error(z, torch.zeros(2, 4), torch.ones(2, 3))
