"""softmax1 (Miller 2023; the zero sink of StreamingLLM) against its formula in float64."""

import numpy as np
import pytest
import torch
from scipy.special import softmax as scipy_softmax

from mmlight import reweighting
from tests.helpers import reweighting_references as ref


def softmax1_formula(z):
    """``exp(z_i) / (1 + sum_j exp(z_j))``, written out (float64, moderate scores)."""
    e = np.exp(z)
    return e / (1 + e.sum())


def test_matches_formula_with_masks():
    scores = torch.randn(3, 4, 7, dtype=torch.float64) * 2
    mask = torch.rand(3, 1, 7) > 0.3
    mask[0] = False  # fully masked rows
    scores[1, 2, 3] = float("-inf")
    got = reweighting.build("softmax1")(scores, mask).numpy()
    np.testing.assert_allclose(got, ref.apply_masked(softmax1_formula, scores.numpy(), mask.numpy()), atol=1e-12)
    assert (got[0] == 0).all()


def test_is_softmax_with_a_zero_logit_for_large_scores():
    """fp32 scores far beyond exp's range: the result is the softmax over the row plus one zero
    logit (scipy, float64), with the zero logit's share dropped."""
    scores = torch.tensor([[300.0, 299.0, -5.0, 0.0], [-400.0, -390.0, -395.0, -420.0], [3.0, 1.0, 0.5, -2.0]])
    got = reweighting.build("softmax1")(scores).double().numpy()
    with_zero = np.concatenate([scores.double().numpy(), np.zeros((3, 1))], axis=1)
    want = scipy_softmax(with_zero, axis=1)[:, :-1]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    assert got[1].sum() < 1e-160 and got[0].sum() == pytest.approx(1.0)  # all mass to nothing / to the keys


def test_null_mass_is_one_over_one_plus_the_sum():
    scores = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)  # 3 * e^0 = 3: the zero logit takes 1/4
    assert reweighting.build("softmax1")(scores).sum().item() == pytest.approx(0.75, abs=1e-15)


@pytest.mark.slow
def test_compile_backend_matches_reference():
    ref.check_compile_backend(reweighting.build("softmax1"), torch.randn(2, 3, 5, 5) * 3, torch.rand(2, 1, 5, 5) > 0.3)
