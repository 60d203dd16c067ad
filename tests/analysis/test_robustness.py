"""The interventions' masks against brute force on small cases, and their effect through a model."""

import math

import pytest
import torch

from mmlight.analysis.robustness import KVEviction, SinkMasking, budget
from mmlight.nn.attention import causal_mask, observe_attention
from mmlight.reweighting import Softmax

SITE = "decoder.layers.3.self_attn"


def brute_force_l2(k, keep, ratio):
    """Each query's kept keys by a loop: itself, and the ceil(r n) lowest-norm of its n past keys."""
    B, H, T, _ = k.shape
    out = torch.zeros(B, H, T, T, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for q in range(T):
                past = [j for j in range(T) if keep[b, q, j] and j != q]
                n_keep = math.ceil(round(ratio * len(past), 9))
                kept = sorted(past, key=lambda j: (float(k[b, h, j].norm()), j))[:n_keep]
                for j in kept + ([q] if keep[b, q, q] else []):
                    out[b, h, q, j] = True
    return out


def brute_force_streaming(keep, ratio, heads):
    B, T, _ = keep.shape
    out = torch.zeros(B, heads, T, T, dtype=torch.bool)
    for b in range(B):
        for q in range(T):
            past = [j for j in range(T) if keep[b, q, j] and j != q]
            n_keep = math.ceil(round(ratio * len(past), 9))
            start = past[:min(4, n_keep)]
            recent = past[len(past) - (n_keep - len(start)):] if n_keep > len(start) else []
            for j in set(start + recent + ([q] if keep[b, q, q] else [])):
                out[b, :, q, j] = True
    return out


@pytest.mark.parametrize("ratio", [1.0, 0.9, 0.7, 0.5, 0.3, 0.1])
def test_l2_and_streaming_eviction_against_brute_force(ratio):
    torch.manual_seed(0)
    B, H, T = 2, 2, 12
    q, k = torch.randn(B, H, T, 4), torch.randn(B, H, T, 4)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, 9:] = False
    keep = causal_mask(T, T)[None] & real[:, None, :]  # (B, T, T)
    mask = keep[:, None]  # (B, 1, T, T) as attention passes it
    got = KVEviction(ratio, "l2", skip_layers=2).edit_mask(SITE, q, k, mask)
    assert torch.equal(got, brute_force_l2(k, keep, ratio))
    got = KVEviction(ratio, "streaming", skip_layers=2).edit_mask(SITE, q, k, mask)
    assert torch.equal(got, brute_force_streaming(keep, ratio, H))
    if ratio == 1.0:
        assert torch.equal(got, mask.expand(B, H, T, T))


def test_eviction_skips_the_first_layers_and_other_kinds():
    q = k = torch.randn(1, 1, 5, 4)
    mask = causal_mask(5, 5)
    evict = KVEviction(0.1, "l2", skip_layers=2)
    assert evict.edit_mask("decoder.layers.1.self_attn", q, k, mask) is mask
    assert evict.edit_mask("decoder.layers.0.cross_attn", q, k, mask) is mask
    assert evict.edit_mask("decoder.layers.2.self_attn", q, k, mask).sum() < mask.sum()


def test_budget_has_no_float_noise():
    assert budget(torch.tensor([10]), 0.7).item() == 7
    assert budget(torch.tensor([10]), 0.1).item() == 1
    assert budget(torch.tensor([3]), 0.5).item() == 2


def test_bad_eviction_arguments():
    with pytest.raises(ValueError, match="keep ratio"):
        KVEviction(0.0)
    with pytest.raises(ValueError, match="method"):
        KVEviction(0.5, "random")


def test_sink_masking_masks_a_hand_built_sink():
    torch.manual_seed(0)
    T = 8
    q = torch.randn(2, 2, T, 4)
    k = torch.randn(2, 2, T, 4) * 0.1
    k[0, :, 5] = q[0].mean(1) * 50  # every query of sample 0 scores key 5 highest
    k[1, :, 2] = q[1].mean(1) * 50
    masking = SinkMasking({"blocks.0": Softmax()}, k=1)
    got = masking.edit_mask("blocks.0", q, k, None)  # (B, nh, T, T)
    assert (~got[0, :, :, 5]).all() and (~got[1, :, :, 2]).all()
    assert got.sum() == 2 * 2 * T * (T - 1)
    assert masking.edit_mask("decoder.layers.0.cross_attn", q, k, None) is None


def test_sink_masking_changes_a_vit_forward_and_is_gone_afterwards():
    from mmlight.models import ReweightedViT, ViTConfig

    model = ReweightedViT(ViTConfig(variant="vit_micro", img_size=8, patch_size=2, in_chans=1, num_classes=10)).eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        plain = model(x)
        with observe_attention(model, SinkMasking(model.attention_sites(), k=5)):
            masked = model(x)
        again = model(x)
    assert not torch.allclose(plain, masked, atol=1e-4)
    assert torch.allclose(plain, again, atol=1e-6)
