"""The learned sink (gpt-oss) against its published definition in float64, its gradient in the sink
logit, and its place in attention and the models."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.special import softmax as scipy_softmax

from mmlight import reweighting
from mmlight.callbacks.reweighting_monitor import monitored_scalars
from mmlight.models.transformer import TransformerConfig, TransformerLM
from mmlight.nn import attention, causal_mask
from mmlight.reweighting import ReweightingSpec
from tests.helpers import reweighting_references as ref

B = [0.0, 1.5, -2.0]  # one sink logit per head


def gpt_oss_row(z, b):
    """gpt-oss's definition (``gpt_oss/torch/model.py``, ``sdpa``): the sink logit appended to the row's
    scores as one more column, softmax, that column dropped (float64)."""
    return scipy_softmax(np.append(z, b))[:-1]


def sink(values=B, dtype=torch.float64, **options):
    module = reweighting.build("sink", num_heads=len(values), **options).to(dtype)
    with torch.no_grad():
        module.sink_logit.copy_(torch.tensor(values, dtype=torch.float64))
    return module


def formula(scores, mask, values=B):
    """The definition on scores ``(B, nh, Tq, Tk)`` with a mask, head h with ``values[h]``; masked
    entries and rows with nothing kept get 0."""
    out = np.zeros(scores.shape)
    mask = np.broadcast_to(mask, scores.shape)
    for h, b in enumerate(values):
        out[:, h] = ref.apply_masked(lambda z: gpt_oss_row(z, b), scores[:, h], mask[:, h])
    return out


def scores_and_mask(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    scores = (torch.randn(2, 3, 5, 6, generator=g) * 3).to(dtype)
    mask = torch.rand(2, 1, 5, 6, generator=g) > 0.3
    mask[0, :, 0] = False  # a fully masked query row in every head
    scores[1, 2, 3, :2] = float("-inf")  # -inf scores act as masked
    scores[1, 1, 4] = float("-inf")  # a row of -inf only: nothing kept
    return scores, mask


def test_matches_gpt_oss_definition_per_head_with_masks():
    scores, mask = scores_and_mask()
    got = sink()(scores, mask).detach().numpy()
    np.testing.assert_allclose(got, formula(scores.numpy(), mask.numpy()), atol=1e-13, rtol=1e-12)
    assert (got[0, :, 0] == 0).all() and (got[1, 1, 4] == 0).all()
    mass = got.sum(-1)
    assert (mass < 1).all() and (mass >= 0).all()


def test_gradient_in_the_sink_logit_is_minus_null_mass_times_the_weighted_upstream():
    """``dw_i / db = -w_i * exp(b) / (exp(b) + sum_j exp(x_j)) = -w_i * (1 - sum_j w_j)``, so
    ``dL/db_h = -sum_rows (1 - sum_j w_j) * sum_i g_i w_i``, computed here from the formula's weights;
    fully masked rows contribute nothing and give no NaN."""
    scores, mask = scores_and_mask()
    upstream = torch.randn(scores.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    module = sink()
    (module(scores, mask) * upstream).sum().backward()
    w = formula(scores.numpy(), mask.numpy())
    per_row = -(1 - w.sum(-1)) * (upstream.numpy() * w).sum(-1)  # (B, nh, Tq)
    np.testing.assert_allclose(module.sink_logit.grad.numpy(), per_row.sum((0, 2)), rtol=1e-12, atol=1e-14)


def test_gradcheck_in_scores_and_sink_logit():
    """Finite differences in float64 (scores near the mask-free interior, masked entries fixed)."""
    scores, mask = scores_and_mask()
    x = torch.where(torch.isfinite(scores), scores, -1.0).requires_grad_()
    b = torch.tensor(B, dtype=torch.float64, requires_grad=True)
    module = sink()

    def weights(x, b):
        return torch.func.functional_call(module, {"sink_logit": b}, (x, mask))

    assert torch.autograd.gradcheck(weights, (x, b))


def test_init_zero_is_softmax1_and_a_large_logit_takes_everything():
    scores = torch.randn(2, 3, 4, 5) * 4
    mask = torch.rand(2, 1, 4, 5) > 0.2
    default = reweighting.build("sink", num_heads=3)
    assert torch.equal(default.sink_logit.detach(), torch.zeros(3))
    torch.testing.assert_close(default(scores, mask), reweighting.build("softmax1")(scores, mask), rtol=0, atol=0)
    swamped = sink([60.0, 60.0, 60.0], dtype=torch.float32)(scores, mask)  # exp(60) > e^4 * 5 by far
    assert swamped.abs().max() < 1e-20


def test_scores_far_beyond_exp_range_in_fp32():
    """fp32 scores and sink logits of hundreds: the result is gpt-oss's, computed by scipy in float64."""
    scores = torch.tensor([[[300.0, 299.0, -5.0], [-400.0, -390.0, -395.0]]])  # (1 head, 2 rows, 3 keys)
    for b in (0.0, 299.5, -1000.0):
        got = sink([b], dtype=torch.float32)(scores).detach().double().numpy()
        want = np.stack([gpt_oss_row(row, b) for row in scores[0].double().numpy()])[None]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


def test_bf16_scores_are_computed_in_fp32_and_close_to_float64():
    scores, mask = scores_and_mask()
    module = sink(dtype=torch.float32)
    got = module(scores.to(torch.bfloat16), mask)
    assert got.dtype == torch.bfloat16
    want = formula(scores.to(torch.bfloat16).double().numpy(), mask.numpy())
    np.testing.assert_allclose(got.detach().double().numpy(), want, atol=4e-3, rtol=1e-2)
    x = scores.to(torch.bfloat16).requires_grad_()
    module(x, mask).float().pow(2).sum().backward()
    assert torch.isfinite(x.grad.float()).all() and torch.isfinite(module.sink_logit.grad).all()


def test_attention_takes_the_explicit_path_and_equals_the_formula(monkeypatch):
    """No SDPA (which returns no log-sum-exp); the output is the formula's weights times v, with a
    causal mask and padding, under a KV cache's shape (fewer queries than keys)."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: pytest.fail("SDPA called"))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, T, 8, generator=g, dtype=torch.float64) for T in (2, 6, 6))
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 1:3] = False
    mask[1] = False  # every key padded: zero output
    module = sink()
    got = attention(q, k, v, module, mask=mask, is_causal=True)
    full = (mask & causal_mask(2, 6)).expand(2, 3, 2, 6)
    scores = (q @ k.transpose(-2, -1)).numpy() * 8**-0.5
    torch.testing.assert_close(got, torch.from_numpy(formula(scores, full.numpy())) @ v)
    assert (got[1] == 0).all()


def test_models_learn_one_logit_per_head_and_monitor_it():
    config = TransformerConfig(
        vocab_size=11, d_model=16, n_heads=4, ffn_dim=16, n_layers=1, max_positions=8, attention=ReweightingSpec("sink")
    )
    module = TransformerLM(config).attention_sites()["decoder.layers.0.self_attn"].module
    assert module.sink_logit.shape == (4,) and module.sink_logit.requires_grad
    logged = monitored_scalars({"decoder.layers.0.self_attn": module})  # what ReweightingMonitor logs
    assert logged == {f"reweighting/decoder.layers.0.self_attn/sink_logit_{h}": 0.0 for h in range(4)}
    fixed = ReweightingSpec("sink", {"num_heads": 1, "init": -1.0, "learnable": False}).build(num_heads=4)
    assert fixed.sink_logit.tolist() == [-1.0] and fixed.monitored() == {}


def test_bad_options_and_head_counts_are_named():
    with pytest.raises(ValueError, match="num_heads >= 1"):
        reweighting.build("sink", num_heads=0)
    with pytest.raises(ValueError, match="finite logit"):
        reweighting.build("sink", init=float("inf"))
    with pytest.raises(ValueError, match="3 heads"):
        sink()(torch.randn(2, 4, 5, 5, dtype=torch.float64))


@pytest.mark.slow
def test_compile_backend_matches_reference():
    ref.check_compile_backend(sink(dtype=torch.float32), torch.randn(2, 3, 5, 5) * 3, torch.rand(2, 1, 5, 5) > 0.3)


def test_tiny_weights_at_extreme_logits_are_exact_in_float64_and_not_zero():
    """Weights of e^-390 and smaller are told apart from 0: float64 against the definition with a relative
    tolerance only (no absolute one, under which 0 and e^-390 agree), and each one positive."""
    scores = torch.tensor([[[300.0, 299.0, -90.0], [-400.0, -390.0, -395.0]]], dtype=torch.float64)
    for b in (0.0, 299.5, -1000.0, 1e4):
        got = sink([b])(scores).detach().numpy()
        want = np.stack([gpt_oss_row(row, b) for row in scores[0].numpy()])[None]
        positive = want > 0  # e^-10000 underflows float64 as well: those must be exact zeros
        np.testing.assert_allclose(got[positive], want[positive], rtol=1e-12, atol=0)
        assert (got[~positive] == 0).all() and (got[positive] > 0).all()
    # b = 0 against [-400, -390, -395]: the sink takes all but ~e^-390 of the mass, which is still there
    w = sink([0.0])(scores).detach()[0, 1]
    assert w[1] == pytest.approx(math.exp(-390), rel=1e-12) and w[0] == pytest.approx(math.exp(-400), rel=1e-12)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b", [60.0, 200.0, 1e4, -1e4])
def test_gradients_with_the_sink_logit_far_from_the_row_maximum_match_float64(dtype, rtol, b):
    """A sink logit far above the row maximum (exp(b) overflows fp32 from b ~ 88.7, and exp(b - x) as well)
    or far below it: the gradients in the scores and in the sink logit are finite and those of float64."""
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(1, 2, 3, 5, generator=g, dtype=torch.float64) * 3
    scores[0, 1, 2] = torch.tensor([90.0, 89.0, -1e4, 1e4 - 1, 1e4])  # scores beyond the fp32 exp range too
    upstream = torch.randn(scores.shape, generator=g, dtype=torch.float64)

    def grads(x, dtype):  # the module's parameter in fp32 for bf16 scores, as in a bf16-mixed run
        module = sink([b, b], dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
        x = x.to(dtype).requires_grad_()
        (module(x).double() * upstream).sum().backward()
        return x.grad.double(), module.sink_logit.grad.double()

    # the reference in float64 from the same (rounded) scores: bf16 rounds 1e4 - 1 to 1e4
    (x_got, b_got), (x_want, b_want) = grads(scores, dtype), grads(scores.to(dtype).double(), torch.float64)
    for got, want in ((x_got, x_want), (b_got, b_want)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item() + 1e-30)
    # d/db = -sum_rows null * sum_i g_i w_i, the null mass sigmoid(b - lse) taken without cancellation
    x = scores.to(dtype).double()
    w, null = sink([b, b])(x).detach(), torch.sigmoid(b - torch.logsumexp(x, -1))
    expected = -(null * (upstream * w).sum(-1)).sum((0, 2))
    torch.testing.assert_close(b_want, expected, rtol=1e-10, atol=1e-300)
