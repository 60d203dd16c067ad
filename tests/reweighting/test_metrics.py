"""The paper's metrics against hand computation and scipy."""

import math

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
    assert math.isnan(multimodality(x, p, eps=5.0).item())  # no relevant entry: M is undefined


def test_sparsity_by_hand():
    x = torch.tensor([[3.0, 2.0, -1.0, -2.0]])
    p = torch.tensor([[0.6, 0.38, 0.02, 0.0]])
    s = 0.05
    want = (np.exp((s - 0.02) / s - 1) + np.exp((s - 0.0) / s - 1)) / 2
    assert sparsity(x, p, eps=0.0, s=s).item() == pytest.approx(want)
    assert math.isnan(sparsity(x, p, eps=-5.0, s=s).item())  # no entry below eps: S is undefined


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


def _row_metrics(x: list[float], p: list[float], eps: float, threshold: float, counted: list[bool]):
    """M, entropy, the fraction below ``threshold`` and S (reference: the row's smallest softmax
    weight) of one row, from the definitions, in Python."""
    top = max(range(len(x)), key=lambda i: x[i])  # the first maximum, as argmax
    gaps = [p[top] - p[n] for n in range(len(x)) if eps < x[n] < x[top]]
    m = 1.0 - sum(gaps) / len(gaps) if gaps else math.nan
    h = -sum(v * math.log(v) for v in p if v > 0)
    kept = [v for v, c in zip(p, counted) if c]
    below = sum(v < threshold for v in kept) / len(kept) if kept else 0.0
    s = min(math.exp(v) for v in x) / sum(math.exp(v) for v in x)
    terms = [math.exp((s - p[n]) / s - 1) for n in range(len(x)) if x[n] < eps]
    sparse = sum(terms) / len(terms) if terms else math.nan
    return m, h, below, sparse


def test_metrics_are_per_row_on_batched_inputs_against_a_python_reference():
    """(2, 3, 5) inputs: each row's value equals the definition computed on that row alone (the rows
    have different maxima; a weight exactly at the threshold is not below it; one row counts a single
    position, one none). M's default relevance threshold is 0."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 4.0, 0.5])[:, None]
    x[1, 2] += 3.0
    p = torch.softmax(2 * x, dim=-1)
    p[0, 1, 2] = 0.0
    p[1, 0, 3] = 0.0625  # exactly the threshold below
    x[0, 0, 4] = 0.0  # exactly M's and S's threshold: neither relevant to M nor small for S
    x[1, 1] = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.25])  # a single score below S's threshold
    mask = torch.rand(2, 3, 5, generator=gen) > 0.3
    mask[1, 0, 3] = True
    mask[0, 0] = torch.tensor([False, False, True, False, False])
    mask[0, 2] = False
    got = (multimodality(x, p), entropy(p), fraction_below(p, 0.0625, mask), sparsity(x, p, eps=0.0))
    for i in range(2):
        for j in range(3):
            want = _row_metrics(x[i, j].tolist(), p[i, j].tolist(), 0.0, 0.0625, mask[i, j].tolist())
            assert [g[i, j].item() for g in got] == pytest.approx(want, rel=1e-6, abs=0, nan_ok=True)  # float32


def test_sparsity_keeps_the_weights_dtype():
    x = torch.randn(3, 6)
    assert sparsity(x, torch.softmax(x, -1), eps=0.0).dtype == torch.float32
