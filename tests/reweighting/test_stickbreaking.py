"""Stick-breaking attention (Tan et al., ICLR 2025) against its product formula in float64, and its
refusal of non-causal attention."""

import numpy as np
import pytest
import torch

from mmlight import reweighting
from mmlight.models.transformer import TransformerConfig, TransformerLM, TransformerSeq2Seq
from mmlight.models.vit import ReweightedViT, ViTConfig
from mmlight.nn import attention, causal_mask
from mmlight.reweighting import ReweightingSpec
from tests.helpers import reweighting_references as ref


def stickbreaking_formula(scores, keep):
    """``w_ij = σ(z_ij) Π_{j<k<pos(i), k kept} (1 - σ(z_ik))`` for kept ``j < pos(i) = Tk - Tq + i``,
    by explicit loops over one ``(Tq, Tk)`` matrix (float64). ``1 - σ(z)`` is written ``1 / (1 + e^z)``:
    as ``1 - σ(z)`` it is 0 in float64 for z > 37, where the log-space result is still exact."""
    q_len, k_len = scores.shape
    sig = 1 / (1 + np.exp(-scores))
    rest = 1 / (1 + np.exp(scores))
    out = np.zeros_like(scores)
    for i in range(q_len):
        pos = k_len - q_len + i
        for j in range(pos):
            if keep[i, j]:
                out[i, j] = sig[i, j] * np.prod([rest[i, k] for k in range(j + 1, pos) if keep[i, k]])
    return out


def formula(scores, keep):
    scores, keep = np.asarray(scores, dtype=np.float64), np.broadcast_to(keep, scores.shape)
    flat = [
        stickbreaking_formula(s, m)
        for s, m in zip(scores.reshape(-1, *scores.shape[-2:]), keep.reshape(-1, *scores.shape[-2:]))
    ]
    return np.stack(flat).reshape(scores.shape)


@pytest.mark.parametrize("q_len", [6, 2])  # 2: the last queries over a key/value cache
def test_matches_formula_with_masks(q_len):
    scores = torch.randn(2, 3, q_len, 6, dtype=torch.float64) * 2
    keep = (torch.rand(2, 1, 1, 6) > 0.3) & causal_mask(q_len, 6)
    keep[0, ..., :] = False  # every key padded
    got = reweighting.build("stickbreaking")(scores, keep).numpy()
    np.testing.assert_allclose(got, formula(scores.numpy(), keep.numpy()), atol=1e-12)
    assert (got[0] == 0).all()


def test_first_query_attends_nothing_and_extreme_scores_stay_exact():
    """fp32 scores of ±60, whose products underflow if taken directly, against float64."""
    scores = torch.tensor(
        [[60.0, -60.0, 5.0, 40.0], [-60.0, -60.0, -60.0, -60.0], [1.0, 2.0, 3.0, 4.0], [-3.0, 60.0, -60.0, 0.5]]
    )
    keep = causal_mask(4, 4)
    got = reweighting.build("stickbreaking")(scores, keep).double().numpy()
    np.testing.assert_allclose(got, formula(scores.double().numpy(), keep.numpy()), rtol=1e-5, atol=1e-30)
    assert (got[0] == 0).all() and got[1, 0] < 1e-25  # query 0 sees no earlier key; σ(-60) ≈ 8.8e-27


def test_incremental_decoding_equals_full_causal_attention():
    q, k, v = (torch.randn(2, 3, 6, 8, dtype=torch.float64) for _ in range(3))
    fn = reweighting.build("stickbreaking")
    full = attention(q, k, v, fn, is_causal=True)
    last = attention(q[:, :, -2:], k, v, fn, is_causal=True)
    torch.testing.assert_close(last, full[:, :, -2:])
    assert (full[:, :, 0] == 0).all()  # the first query attends to nothing


def test_refuses_non_causal_attention():
    with pytest.raises(ValueError, match="needs is_causal=True"):
        attention(*(torch.randn(1, 1, 3, 4) for _ in range(3)), reweighting.build("stickbreaking"))


def test_refuses_non_causal_layers_when_the_model_is_built():
    spec = ReweightingSpec("stickbreaking")
    base = {"vocab_size": 11, "d_model": 16, "n_heads": 2, "ffn_dim": 16, "n_layers": 1, "max_positions": 8}
    model = TransformerLM(TransformerConfig(**base, attention=spec))  # decoder-only: causal everywhere
    assert all(site.module.causal_only for site in model.attention_sites().values())
    with pytest.raises(ValueError, match="encoder self-attention is not causal"):
        TransformerSeq2Seq(TransformerConfig(**base, n_encoder_layers=1, attention=spec))
    with pytest.raises(ValueError, match="ViT self-attention is not causal"):
        ReweightedViT(ViTConfig(variant="vit_micro", img_size=8, patch_size=4, num_classes=3, attention=spec))


@pytest.mark.slow
def test_compile_backend_matches_reference():
    scores = torch.randn(2, 3, 5, 5) * 3
    keep = (torch.rand(2, 1, 5, 5) > 0.3) & causal_mask(5, 5)
    ref.check_compile_backend(reweighting.build("stickbreaking"), scores, keep)
