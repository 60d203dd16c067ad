"""α-entmax with a learned α per head (Correia, Niculae & Martins 2019) against a float64 bisection."""

import numpy as np
import pytest
import torch

from mmlight import reweighting
from mmlight.callbacks.reweighting_monitor import monitored_scalars
from tests.helpers import reweighting_references as ref

ALPHAS = [1.2, 1.5, 1.9]  # one per head


def entmax_formula(z, alpha, iters=200):
    """``p_i = [(α - 1) z_i - τ]_+ ^ (1 / (α - 1))`` with τ found by bisection so that the p sum to 1."""
    z = (alpha - 1) * z
    lo, hi = z.max() - 1.0, z.max()  # at τ = max - 1 the largest term alone is 1; at τ = max all are 0

    def total(tau):
        return (np.maximum(z - tau, 0) ** (1 / (alpha - 1))).sum()

    for _ in range(iters):
        lo, hi = ((lo + hi) / 2, hi) if total((lo + hi) / 2) >= 1 else (lo, (lo + hi) / 2)
    p = np.maximum(z - (lo + hi) / 2, 0) ** (1 / (alpha - 1))
    return p / p.sum()


def alpha_entmax(alphas=ALPHAS):
    module = reweighting.build("alpha_entmax", num_heads=len(alphas)).double()
    with torch.no_grad():  # α = 1 + sigmoid(a)
        module.alpha_logit.copy_(torch.logit(torch.tensor(alphas, dtype=torch.float64) - 1))
    return module


def test_matches_bisection_per_head_with_masks():
    scores = torch.randn(2, 3, 4, 7, dtype=torch.float64) * 2
    mask = torch.rand(2, 1, 1, 7) > 0.3
    mask[0] = False
    scores[1, 2, 3, 0] = float("-inf")
    got = alpha_entmax()(scores, mask).detach().numpy()
    for h, alpha in enumerate(ALPHAS):
        want = ref.apply_masked(lambda z: entmax_formula(z, alpha), scores[:, h].numpy(), mask[:, 0].numpy())
        np.testing.assert_allclose(got[:, h], want, atol=1e-9)
    assert (got[0] == 0).all()


def test_alpha_two_is_sparsemax_and_one_and_a_half_is_entmax15():
    scores = torch.randn(6, 9, dtype=torch.float64) * 2
    for alpha, row_fn in ((1.5, ref.entmax15), (2.0 - 1e-12, ref.sparsemax)):
        got = alpha_entmax([alpha])(scores).detach().numpy()
        np.testing.assert_allclose(got, np.stack([row_fn(z) for z in scores.numpy()]), atol=1e-6)


def test_gradient_in_alpha_against_finite_differences_of_the_bisection():
    scores = torch.randn(3, 8, dtype=torch.float64) * 2
    direction = torch.randn(3, 8, dtype=torch.float64)
    module = alpha_entmax([1.4])
    (module(scores) * direction).sum().backward()
    logit, h = module.alpha_logit.item(), 1e-6

    def loss(a):
        alpha = 1 + 1 / (1 + np.exp(-a))
        return (np.stack([entmax_formula(z, alpha) for z in scores.numpy()]) * direction.numpy()).sum()

    numeric = (loss(logit + h) - loss(logit - h)) / (2 * h)
    assert module.alpha_logit.grad.item() == pytest.approx(numeric, rel=1e-4, abs=1e-7)


def test_monitored_alpha_per_head_and_options():
    module = reweighting.build("alpha_entmax", num_heads=4)
    alpha = module.monitored()["alpha"]
    assert alpha.shape == (4,) and torch.allclose(alpha, torch.tensor(1.5))
    logged = monitored_scalars({"blocks.0": module})  # what ReweightingMonitor logs
    assert logged == pytest.approx({f"reweighting/blocks.0/alpha_{h}": 1.5 for h in range(4)})
    assert reweighting.build("alpha_entmax", learnable=False).monitored() == {}
    with pytest.raises(ValueError, match="init must lie in"):
        reweighting.build("alpha_entmax", init=2.0)


@pytest.mark.slow
def test_compile_backend_matches_reference():
    module = reweighting.build("alpha_entmax", num_heads=3, n_iter=8)  # 8 bisection steps: a shorter graph
    ref.check_compile_backend(module, torch.randn(2, 3, 5, 5) * 3, torch.rand(2, 1, 5, 5) > 0.3)


def test_float32_gradients_equal_float64_on_4d_scores_with_many_zero_weights_near_alpha_two():
    """The backward reduces over the keys of ``(B, nh, Tq, Tk)`` scores, and a zero weight has no gradient
    even near α = 2, where ``tiny ** (2 - α)`` is not negligible in float32."""
    scores = torch.randn(2, 3, 4, 9, dtype=torch.float64) * 4
    direction = torch.randn_like(scores)
    grads = {}
    for dtype in (torch.float32, torch.float64):
        module = alpha_entmax([1.2, 1.5, 1.95]).to(dtype)
        x = scores.to(dtype).requires_grad_()
        (module(x) * direction.to(dtype)).sum().backward()
        grads[dtype] = (x.grad.double(), module.alpha_logit.grad.double())
    assert (module(scores) == 0).float().mean() > 0.3
    torch.testing.assert_close(grads[torch.float32], grads[torch.float64], rtol=1e-4, atol=1e-5)


def test_alpha_stays_in_the_documented_range_at_any_logit():
    """α = 1 + max(sigmoid(a), 0.01): 1.01 exactly for a very negative logit, 2 exactly where the fp32
    sigmoid saturates, and the paper's 1 + sigmoid(a) in between (docs/reweightings.md: α ∈ [1.01, 2])."""
    module = reweighting.build("alpha_entmax", num_heads=4)
    with torch.no_grad():
        module.alpha_logit.copy_(torch.tensor([-1e4, -3.0, 0.7, 1e4]))
    alpha = module.alpha.detach().double()
    want = [1 + np.float32(0.01), 1 + 1 / (1 + np.exp(3.0)), 1 + 1 / (1 + np.exp(-0.7)), 2.0]
    np.testing.assert_allclose(alpha.numpy(), want, rtol=1e-6)
    assert alpha[0] > 1 and alpha[-1] == 2.0
