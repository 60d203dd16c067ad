"""Softpick (Zuhri, Fuadi & Aji 2025) against its formula in float64."""

import numpy as np
import pytest
import torch

from mmlight import reweighting
from tests.helpers import reweighting_references as ref

EPS = 1e-6


def softpick_formula(z, eps=EPS):
    """``relu(exp(z_i) - 1) / (sum_j |exp(z_j) - 1| + eps)``, written out (float64)."""
    e = np.exp(z) - 1
    return np.maximum(e, 0) / (np.abs(e).sum() + eps)


def test_matches_formula_with_masks():
    scores = torch.randn(3, 4, 7, dtype=torch.float64) * 2
    mask = torch.rand(3, 1, 7) > 0.3
    mask[0] = False
    scores[1, 2, 3] = float("-inf")
    got = reweighting.build("softpick")(scores, mask).numpy()
    np.testing.assert_allclose(got, ref.apply_masked(softpick_formula, scores.numpy(), mask.numpy()), atol=1e-12)
    assert (got[0] == 0).all()


def test_stable_for_scores_beyond_fp32_exp():
    """fp32 scores up to 200 (exp overflows fp32 above ~88) against the plain formula in float64."""
    scores = torch.tensor(
        [[200.0, 199.0, 150.0, -3.0, 0.0], [90.0, 1.0, -1.0, 0.5, -200.0], [-1.0, -2.0, -0.5, -9.0, -4.0]]
    )
    got = reweighting.build("softpick")(scores).double().numpy()
    want = np.stack([softpick_formula(row) for row in scores.double().numpy()])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30)
    assert (got[2] == 0).all()  # no positive score: the row attends to nothing


def test_scores_at_zero_give_zero_weight():
    """A row of zeros is 0/eps = 0 (no 0/0), and the eps option reaches the denominator."""
    assert (reweighting.build("softpick")(torch.zeros(2, 5)) == 0).all()
    scores = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    got = reweighting.build("softpick", eps=0.5)(scores).numpy()
    np.testing.assert_allclose(got, softpick_formula(scores.numpy(), eps=0.5), atol=1e-15)
    with pytest.raises(ValueError, match="eps must be positive"):
        reweighting.build("softpick", eps=0.0)


@pytest.mark.slow
def test_compile_backend_matches_reference():
    ref.check_compile_backend(reweighting.build("softpick"), torch.randn(2, 3, 5, 5) * 3, torch.rand(2, 1, 5, 5) > 0.3)
