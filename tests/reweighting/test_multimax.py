"""MultiMax specifics: Eq. 4-6, the official parameter layout, and Proposition 4.2."""

import numpy as np
import pytest
import torch

from mmlight.reweighting import MultiMax, multimax_sigma, multimodality, sparsity
from tests.helpers import reweighting_references as ref


def set_params(module, ranges, ts):
    with torch.no_grad():
        module.ranges.copy_(torch.tensor(ranges))
        module.ts.copy_(torch.tensor(ts))
    return module


@pytest.mark.parametrize("order", [1, 2])
def test_zero_ts_is_softmax(order):
    module = set_params(MultiMax(order=order).double(), [0.3, -0.2, 0.5, 0.1][: 2 * order], [0.0] * (2 * order))
    scores = torch.randn(5, 11, dtype=torch.float64) * 3
    mask = torch.rand(5, 11) > 0.2
    want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    torch.testing.assert_close(module(scores, mask), want)


def test_first_order_is_eq5_piecewise_linear():
    """sigma in the official relu form equals Eq. 5: slope t_b below b, t_d above d, identity between."""
    b, d, t_b, t_d = -0.5, 1.0, 2.5, 0.4
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    got = multimax_sigma(
        x, torch.tensor([b, d], dtype=torch.float64), torch.tensor([1 - t_b, t_d - 1], dtype=torch.float64)
    )
    np.testing.assert_allclose(got.numpy(), ref.multimax_sigma_piecewise(x.numpy(), b, d, t_b, t_d), atol=1e-12)


def test_second_order_terms():
    x = torch.tensor([-3.0, -1.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    ranges = torch.tensor([0.0, 0.0, -1.0, 1.0], dtype=torch.float64)
    ts = torch.tensor([0.0, 0.0, 0.5, -0.25], dtype=torch.float64)
    # only the quadratic terms act: +0.5 (−1−x)^2 below −1, −0.25 (x−1)^2 above 1
    want = torch.tensor([-3.0 + 0.5 * 4, -1.0, 0.0, 1.0, 3.0 - 0.25 * 4], dtype=torch.float64)
    torch.testing.assert_close(multimax_sigma(x, ranges, ts), want)


def test_official_state_dict_layout_loads():
    official = {"ranges": torch.tensor([0.1, -0.2, 0.3, 0.05]), "ts": torch.tensor([-0.5, 0.2, 0.01, -0.03])}
    module = MultiMax(order=2)
    module.load_state_dict(official, strict=True)
    x = torch.randn(7)
    r, t = official["ranges"], official["ts"]
    official_sigma = (
        x
        + t[0] * torch.relu(r[0] - x)
        + t[1] * torch.relu(x - r[1])
        + t[2] * torch.relu(r[2] - x) ** 2
        + t[3] * torch.relu(x - r[3]) ** 2
    )
    torch.testing.assert_close(module.modulate(x), official_sigma)


def test_init_is_close_to_softmax():
    """Whatever the draw (torch releases draw ``trunc_normal_`` differently from one seed): with every
    parameter within c = 0.04 (2 std), each of sigma's terms moves a logit x by at most c (|x| + c) or
    c (|x| + c)^2, so a row's largest move D changes each probability p by at most p (e^2D - 1)."""
    torch.manual_seed(1)
    module = MultiMax(order=2)
    c = 0.04
    assert module.ranges.abs().max() <= c and module.ts.abs().max() <= c
    assert module.ranges.std() > 0 and module.ts.std() > 0  # actually random, not zeros
    scores = torch.randn(16, 32)
    reach = scores.abs() + c
    largest_move = (2 * c * reach + 2 * c * reach**2).amax(-1, keepdim=True)
    softmax = torch.softmax(scores, -1)
    with torch.no_grad():
        assert ((module(scores) - softmax).abs() <= softmax * torch.expm1(2 * largest_move)).all()


def test_bad_order_and_shapes():
    with pytest.raises(ValueError, match="order must be 1 or 2"):
        MultiMax(order=3)
    with pytest.raises(ValueError, match=r"shape \(2,\) or \(4,\)"):
        multimax_sigma(torch.zeros(3), torch.zeros(3), torch.zeros(3))


class TestProposition42:
    """Proposition 4.2 with t_b > 1 (MultiMax-1: term (1) only, t_d = 1), on constructed inputs.

    Statement 1 (sparser than softmax at temperature 1) holds. Statement 2, read literally with
    Definition 3.2, cannot hold: for t_b > 1, sigma(x) < x below b and sigma(x) = x above it, so the
    normaliser shrinks, every weight above b grows by the same factor and every gap
    p_max - p_n grows, which lowers M. What does hold, and is what the paper's Pareto argument
    needs, is that no softmax temperature reaches MultiMax-1's (sparsity, multi-modality) pair:
    at equal sparsity, softmax is less multi-modal. Both facts are checked here.
    """

    X = torch.tensor([[2.0, 1.5, 1.0, -0.5, -1.0, -2.0], [3.0, 2.2, 0.4, -0.1, -0.3, -2.5]], dtype=torch.float64)
    EPS = 0.0  # entries below 0 count for sparsity, above it for multi-modality; b = 0 too

    def points(self, t_b):
        module = set_params(MultiMax(order=1).double(), [0.0, 1e3], [1 - t_b, 0.0])
        s_ref = torch.softmax(self.X, -1).amin(-1, keepdim=True)  # the paper's reference s
        p_mm = module(self.X).detach()
        return s_ref, sparsity(self.X, p_mm, self.EPS, s_ref), multimodality(self.X, p_mm, self.EPS)

    @pytest.mark.parametrize("t_b", [1.5, 3.0])
    def test_statement_1_sparser_than_softmax(self, t_b):
        s_ref, s_mm, _ = self.points(t_b)
        s_sm = sparsity(self.X, torch.softmax(self.X, -1), self.EPS, s_ref)
        assert (s_mm > s_sm).all()

    @pytest.mark.parametrize("t_b", [1.5, 3.0])
    def test_statement_2_literal_reading_fails(self, t_b):
        _, _, m_mm = self.points(t_b)
        assert (m_mm < multimodality(self.X, torch.softmax(self.X, -1), self.EPS)).all()

    @pytest.mark.parametrize("t_b", [1.5, 3.0])
    def test_no_softmax_temperature_dominates(self, t_b):
        s_ref, s_mm, m_mm = self.points(t_b)
        temps = torch.logspace(-1.5, 1.5, 4001, dtype=torch.float64)  # inverse temperatures t
        for row in range(self.X.shape[0]):
            x = self.X[row].expand(len(temps), -1)
            p = torch.softmax(temps[:, None] * x, -1)
            s_sm = sparsity(x, p, self.EPS, s_ref[row])
            m_sm = multimodality(x, p, self.EPS)
            dominated = (s_sm >= s_mm[row]) & (m_sm >= m_mm[row])
            assert not dominated.any()
            # and the frontier is really traced: some t is as sparse, some t as multi-modal
            assert (s_sm >= s_mm[row]).any() and (m_sm >= m_mm[row]).any()


class TestTermsOption:
    """``terms="low"`` (the paper's MultiMax-l, Table 5 row 2): term (1) alone, official layout kept."""

    def test_low_is_eq7_and_ignores_the_t_d_entries(self):
        b, t_b = -0.5, 2.5
        module = MultiMax(order=1, terms="low").double()
        # an official first-order state dict with a non-zero t_d entry: it loads, and is ignored
        module.load_state_dict({"ranges": torch.tensor([b, 1.0]), "ts": torch.tensor([1 - t_b, 0.7])}, strict=True)
        x = torch.linspace(-4, 4, 101, dtype=torch.float64)
        want = ref.multimax_sigma_piecewise(x.numpy(), b, float("inf"), t_b, 1.0)  # Eq. 7: slope t_b below b only
        np.testing.assert_allclose(module.modulate(x).detach().numpy(), want, atol=1e-12)

    @pytest.mark.parametrize("order", [1, 2])
    def test_low_gives_t_d_and_d_zero_gradient(self, order):
        torch.manual_seed(0)
        module = MultiMax(order=order, terms="low", init_std=0.5)
        assert torch.all(module.ts.view(order, 2)[:, 1] == 0)  # stored as 0
        with torch.no_grad():
            module.ts.copy_(torch.randn(2 * order))  # even when a loaded dict makes them non-zero
        module(torch.randn(4, 9) * 3).pow(2).sum().backward()
        assert torch.all(module.ts.grad.view(order, 2)[:, 1] == 0)
        assert torch.all(module.ranges.grad.view(order, 2)[:, 1] == 0)
        assert torch.all(module.ts.grad.view(order, 2)[:, 0] != 0)

    def test_both_is_unchanged_by_the_option(self):
        torch.manual_seed(0)
        module = MultiMax(order=2, init_std=0.5)
        assert module.active_ts() is module.ts
        with pytest.raises(ValueError, match="terms must be 'both' or 'low'"):
            MultiMax(terms="high")

    @pytest.mark.parametrize("order", [1, 2])
    def test_triton_kernels_honour_low(self, order):
        """Row-wise and cross-entropy kernels (under TRITON_INTERPRET on the CPU) against the reference."""
        torch.manual_seed(0)
        module = MultiMax(order=order, terms="low", init_std=0.5)
        with torch.no_grad():
            module.ts.copy_(torch.randn(2 * order))
        scores = torch.randn(3, 17) * 2
        outputs = {}
        for backend in ("reference", "triton"):
            module.zero_grad()
            probs = module.compute(scores, None, backend)
            module.backend = backend
            loss = module.cross_entropy(scores, torch.tensor([1, 5, 16]), label_smoothing=0.1)
            (probs.pow(2).sum() + loss).backward()
            outputs[backend] = (probs.detach(), loss.detach(), module.ts.grad.clone(), module.ranges.grad.clone())
        for got, want in zip(outputs["triton"], outputs["reference"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        assert torch.all(outputs["triton"][2].view(order, 2)[:, 1] == 0)


class TestIdentityStart:
    """``init_std=0``: ranges = ts = 0, so sigma is the identity and the layer is softmax exactly."""

    @pytest.mark.parametrize("order, terms", [(1, "both"), (2, "both"), (2, "low")])
    def test_sigma_is_identity_and_weights_are_softmax(self, order, terms):
        module = MultiMax(order=order, terms=terms, init_std=0).double()
        assert torch.equal(module.ranges, torch.zeros(2 * order, dtype=torch.float64))
        assert torch.equal(module.ts, torch.zeros(2 * order, dtype=torch.float64))
        scores = torch.randn(4, 9, dtype=torch.float64) * 5
        assert torch.equal(module.modulate(scores), scores)
        mask = torch.rand(4, 9) > 0.3
        want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
        torch.testing.assert_close(module(scores, mask), want, atol=1e-15, rtol=0)

    def test_still_learns(self):
        """Zero parameters still get a gradient (the relu kinks sit at 0, not a dead zone)."""
        module = MultiMax(order=2, init_std=0)
        scores = torch.randn(6, 7) * 3
        (module(scores, None) * torch.randn(6, 7)).sum().backward()
        assert module.ts.grad.abs().sum() > 0

    @pytest.mark.parametrize("std", [-0.1, float("nan")])
    def test_negative_std_is_an_error(self, std):
        with pytest.raises(ValueError, match="init_std"):
            MultiMax(init_std=std)


def _smoothed_nll_float64(sigma: torch.Tensor, target: torch.Tensor, smoothing: float, ignore: int, reduction: str):
    """Label-smoothed cross-entropy written out: ``(1 - e) * -log p_y + e * mean_c -log p_c`` per
    counted target, then their mean or sum (``ignore`` targets count in neither)."""
    logp = torch.log_softmax(sigma.double(), dim=-1)  # (T, V)
    kept = target != ignore
    per = (1 - smoothing) * -logp[kept, target[kept]] + smoothing * -logp[kept].mean(-1)
    return per.mean() if reduction == "mean" else per.sum()


@pytest.mark.parametrize("backend", ["auto", "reference", "compile"])
def test_cross_entropy_of_the_modulated_logits_against_float64(backend, monkeypatch):
    """bf16 logits are computed in fp32; label smoothing, the ignored index and the reduction are the
    ones asked for (defaults: none, -100, mean); ``compile`` runs the compiled reference (here a spy,
    so that nothing compiles), the others the eager one."""
    from mmlight.reweighting import multimax

    compiled = []

    def spy():
        return lambda *args: compiled.append(args) or multimax.multimax_cross_entropy_reference(*args)

    monkeypatch.setattr(multimax, "_compiled_cross_entropy", spy)
    module = set_params(MultiMax(order=2, backend=backend), [-0.5, 0.5, -1.0, 1.0], [0.3, 0.2, 0.1, 0.05])
    logits = (torch.randn(6, 9, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    sigma = module.modulate(logits.double())
    calls = [
        ([0, 3, 8, -100, 1, 5], (), (0.0, -100, "mean")),
        ([0, 3, 8, 2, 1, 5], (0.1, 5, "sum"), (0.1, 5, "sum")),
        ([0, 3, 8, -100, 1, 5], (0.2, -100, "mean"), (0.2, -100, "mean")),
    ]
    for target, args, (smoothing, ignore, reduction) in calls:
        target = torch.tensor(target)
        got = module.cross_entropy(logits, target, *args)
        assert got.dtype == torch.float32
        want = _smoothed_nll_float64(sigma, target, smoothing, ignore, reduction)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
        reference = multimax.multimax_cross_entropy_reference(logits, target, module.ranges, module.ts, *args)
        torch.testing.assert_close(reference, got, rtol=0, atol=0)  # the reference's defaults are the method's
    assert len(compiled) == (3 if backend == "compile" else 0)
