"""Scalable-Softmax (Nakanishi 2025) against its formula in float64, and its SDPA path."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmlight import reweighting
from mmlight.callbacks.reweighting_monitor import monitored_scalars
from mmlight.models.transformer import TransformerConfig, TransformerLM
from mmlight.nn import attention, causal_mask
from mmlight.reweighting import ReweightingSpec
from tests.helpers import reweighting_references as ref

S = [0.43, 1.2, -0.3]  # one scale per head


def ssmax_formula(z, s):
    """The paper's form ``n^(s z_i) / sum_j n^(s z_j)``, n the row's number of keys (float64)."""
    powers = float(len(z)) ** (s * (z - z.max()))
    return powers / powers.sum()


def ssmax(num_heads=3, values=S, dtype=torch.float64):
    module = reweighting.build("ssmax", num_heads=num_heads).to(dtype)
    with torch.no_grad():
        module.s.copy_(torch.tensor(values[:num_heads], dtype=torch.float64))
    return module


def formula_per_head(scores, mask, values=S):
    """The formula on scores ``(B, nh, Tq, Tk)``, head h with ``values[h]``."""
    out = np.zeros(scores.shape)
    for h, s in enumerate(values[: scores.shape[1]]):
        out[:, h] = ref.apply_masked(lambda z: ssmax_formula(z, s), scores[:, h], mask[:, h])
    return out


def test_matches_formula_per_head_with_masks():
    scores = torch.randn(2, 3, 6, 6, dtype=torch.float64) * 2
    mask = ((torch.rand(2, 1, 1, 6) > 0.3) & causal_mask(6, 6)).expand(2, 3, 6, 6).clone()
    mask[0, :, 0] = False  # fully masked rows
    got = ssmax()(scores, mask).detach().numpy()
    np.testing.assert_allclose(got, formula_per_head(scores.numpy(), mask.numpy()), atol=1e-12)
    assert (got[0, :, 0] == 0).all()


def qkv(Tq=6, Tk=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, 3, T, 8, generator=g, dtype=dtype) for T in (Tq, Tk, Tk)]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("q_len", [6, 2])  # 2 queries over 6 keys: incremental decoding with a cache
def test_sdpa_with_scaled_queries_equals_the_formula(is_causal, padded, q_len, monkeypatch):
    """Attention runs ssmax through SDPA (queries scaled by s * log n_i, n_i the keys each query
    sees); its output equals the formula's weights, computed here from explicit scores, times v."""
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    q, k, v = qkv(Tq=q_len)
    mask = None
    if padded:
        mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
        mask[0, ..., 1:3] = False
        mask[1, ..., :] = False  # every key padded: zero output
    module = ssmax()
    got = attention(q, k, v, module, mask=mask, is_causal=is_causal)
    assert calls and isinstance(got, torch.Tensor)
    full = torch.ones(2, 3, q_len, 6, dtype=torch.bool)
    full = full & (True if mask is None else mask) & (causal_mask(q_len, 6) if is_causal else True)
    scores = (q @ k.transpose(-2, -1)).numpy() * 8**-0.5
    want = torch.from_numpy(formula_per_head(scores, full.numpy())) @ v
    torch.testing.assert_close(got, want)


def test_gradient_in_s_through_sdpa_equals_the_explicit_path():
    q, k, v = qkv(dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 4:] = False
    module = ssmax()
    attention(q, k, v, module, mask=mask, is_causal=True).pow(2).sum().backward()
    via_sdpa, module.s.grad = module.s.grad.clone(), None
    scores = (q @ k.transpose(-2, -1)) * 8**-0.5
    weights = module(scores, mask & causal_mask(6, 6))
    (weights @ v).pow(2).sum().backward()
    torch.testing.assert_close(via_sdpa, module.s.grad)


def test_half_precision_through_sdpa_is_finite():
    q, k, v = qkv(dtype=torch.bfloat16)
    y = attention(q, k, v, ssmax(dtype=torch.bfloat16), is_causal=True)
    want = attention(*(t.double() for t in (q, k, v)), ssmax(), is_causal=True)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), want, atol=0.05, rtol=0.05)


def test_models_learn_one_scale_per_head_and_monitor_it():
    config = TransformerConfig(
        vocab_size=11,
        d_model=16,
        n_heads=4,
        ffn_dim=16,
        n_layers=1,
        max_positions=8,
        attention=ReweightingSpec("ssmax"),
    )
    module = TransformerLM(config).attention_sites()["decoder.layers.0.self_attn"].module
    assert module.s.shape == (4,) and torch.allclose(module.s, torch.tensor(0.43))
    assert set(module.monitored()) == {"s"}
    logged = monitored_scalars({"decoder.layers.0.self_attn": module})  # what ReweightingMonitor logs
    assert logged == pytest.approx({f"reweighting/decoder.layers.0.self_attn/s_{h}": 0.43 for h in range(4)})
    fixed = ReweightingSpec("ssmax", {"num_heads": 1, "learnable": False}).build(num_heads=4)
    assert fixed.s.shape == (1,) and fixed.monitored() == {}


def test_heads_must_match():
    with pytest.raises(ValueError, match="3 heads"):
        ssmax()(torch.randn(2, 4, 5, 5, dtype=torch.float64))


@pytest.mark.slow
def test_compile_backend_matches_reference():
    ref.check_compile_backend(ssmax(dtype=torch.float32), torch.randn(2, 3, 5, 5) * 3, torch.rand(2, 1, 5, 5) > 0.3)
