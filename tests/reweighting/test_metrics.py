"""The paper's metrics against hand computation and scipy."""

import numpy as np
import pytest
import scipy.stats
import torch

from mmlight.reweighting import entropy, fraction_below, multimodality, sparsity


def test_multimodality_by_hand():
    x = torch.tensor([[3.0, 2.0, 1.0, -1.0]])
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    # relevant (eps=0): x=2 and x=1 -> gaps 0.2 and 0.35
    assert multimodality(x, p, eps=0.0).item() == pytest.approx(1 - (0.2 + 0.35) / 2)
    # nothing relevant besides the max -> 1
    assert multimodality(x, p, eps=5.0).item() == 1.0


def test_sparsity_by_hand():
    x = torch.tensor([[3.0, 2.0, -1.0, -2.0]])
    p = torch.tensor([[0.6, 0.38, 0.02, 0.0]])
    s = 0.05
    want = (np.exp((s - 0.02) / s - 1) + np.exp((s - 0.0) / s - 1)) / 2
    assert sparsity(x, p, eps=0.0, s=s).item() == pytest.approx(want)
    assert sparsity(x, p, eps=-5.0, s=s).item() == 0.0


def test_sparsity_default_reference_is_softmax_min():
    x = torch.randn(3, 8, dtype=torch.float64)
    p = torch.softmax(x, -1)
    s = p.amin(-1, keepdim=True)
    torch.testing.assert_close(sparsity(x, p, eps=0.0), sparsity(x, p, eps=0.0, s=s))


def test_entropy_matches_scipy():
    p = torch.softmax(torch.randn(4, 9, dtype=torch.float64), -1)
    p[0, :3] = 0
    p[0] /= p[0].sum()
    np.testing.assert_allclose(entropy(p).numpy(), scipy.stats.entropy(p.numpy(), axis=-1))


def test_fraction_below():
    p = torch.tensor([[0.0, 0.0005, 0.2, 0.7995], [0.25, 0.25, 0.25, 0.25]])
    mask = torch.tensor([[True, False, True, True], [True, True, True, True]])
    torch.testing.assert_close(fraction_below(p, 1e-3), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(fraction_below(p, 1e-3, mask), torch.tensor([1 / 3, 0.0]))
