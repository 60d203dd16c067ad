"""Sigmoid attention (Ramapuram et al., ICLR 2025) against its formula in float64."""

import numpy as np
import pytest
import torch

from mmlight import reweighting
from mmlight.nn import causal_mask
from tests.helpers import reweighting_references as ref


def sigmoid_formula(z, bias=None):
    """``1 / (1 + exp(-(z_i + b)))`` with ``b = -log n``, n the row's number of keys (float64)."""
    b = -np.log(len(z)) if bias is None else bias
    return 1 / (1 + np.exp(-(z + b)))


def test_matches_formula_with_masks():
    """n is the number of kept keys of each row: padding and a causal mask change it per row."""
    scores = torch.randn(3, 6, 6, dtype=torch.float64) * 2
    mask = (torch.rand(3, 1, 6) > 0.3) & causal_mask(6, 6)
    mask[0] = False
    scores[1, 2, 0] = float("-inf")
    got = reweighting.build("sigmoid")(scores, mask).numpy()
    np.testing.assert_allclose(got, ref.apply_masked(sigmoid_formula, scores.numpy(), mask.numpy()), atol=1e-12)
    assert (got[0] == 0).all()


def test_fixed_bias():
    scores = torch.randn(4, 5, dtype=torch.float64)
    got = reweighting.build("sigmoid", bias=-2.0)(scores).numpy()
    np.testing.assert_allclose(got, sigmoid_formula(scores.numpy(), bias=-2.0), atol=1e-12)


def test_row_sum_is_not_bounded_by_one():
    """Each weight is in [0, 1] but a row of high scores sums to more than 1, as the formula says:
    4 keys at score 10 give 4 * sigmoid(10 - log 4)."""
    p = reweighting.build("sigmoid")(torch.full((4,), 10.0, dtype=torch.float64))
    assert p.sum().item() == pytest.approx(4 / (1 + np.exp(-(10 - np.log(4)))), abs=1e-12)
    assert p.sum().item() > 3.9


@pytest.mark.slow
def test_compile_backend_matches_reference():
    ref.check_compile_backend(reweighting.build("sigmoid"), torch.randn(2, 3, 5, 5) * 3, torch.rand(2, 1, 5, 5) > 0.3)
