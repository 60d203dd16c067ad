"""The attention entry point: fused and explicit paths agree, masks and causality are right."""

import pytest
import torch
from timm.layers import Attention as TimmAttention

from mmlight import reweighting
from mmlight.nn import ReweightedAttention, attention, causal_mask
from mmlight.nn.attention import key_padding_of
from mmlight.reweighting import MultiMax


def manual_attention(q, k, v, mask, scale):
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, -1))  # empty rows -> 0
    return probs @ v


def qkv(B=2, H=3, Tq=5, Tk=5, D=8):
    return (
        torch.randn(B, H, Tq, D, dtype=torch.float64),
        torch.randn(B, H, Tk, D, dtype=torch.float64),
        torch.randn(B, H, Tk, D, dtype=torch.float64),
    )


def zero_ts_multimax():
    module = reweighting.build("multimax").double()
    with torch.no_grad():
        module.ts.zero_()
    return module


def test_causal_mask_bottom_right():
    m = causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


@pytest.mark.parametrize("is_causal", [False, True])
def test_fused_and_explicit_paths_match_manual(is_causal):
    q, k, v = qkv()
    mask = torch.rand(2, 1, 1, 5) > 0.3
    mask[0, ..., :] = False  # batch 0: every key padded
    mask[1, ..., 0] = True
    full = mask & causal_mask(5, 5) if is_causal else mask.expand(2, 1, 5, 5)
    want = manual_attention(q, k, v, full, 8**-0.5)
    softmax = reweighting.build("softmax")
    assert softmax.sdpa_scale == 1.0  # takes the fused path
    fused = attention(q, k, v, softmax, mask=mask, is_causal=is_causal)
    explicit = attention(q, k, v, zero_ts_multimax(), mask=mask, is_causal=is_causal)
    torch.testing.assert_close(fused, want)
    torch.testing.assert_close(explicit, want)
    assert (fused[0] == 0).all()


def test_temperature_folds_into_sdpa_scale():
    q, k, v = qkv()
    got = attention(q, k, v, reweighting.build("softmax", temperature=0.5))
    want = manual_attention(q, k, v, torch.ones(5, 5, dtype=torch.bool), 8**-0.5 / 0.5)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", reweighting.available())
def test_incremental_query_matches_full_causal(name):
    q, k, v = qkv(Tq=6, Tk=6)
    fn = reweighting.build(name).double()
    full = attention(q, k, v, fn, is_causal=True)
    last = attention(q[:, :, -2:], k, v, fn, is_causal=True)  # 2 new queries over a 6-key cache
    torch.testing.assert_close(last, full[:, :, -2:])


@pytest.mark.parametrize("name", reweighting.available())
def test_padded_causal_batch_has_finite_grads(name):
    q, k, v = (t.float().requires_grad_() for t in qkv())
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., :] = False
    out = attention(q, k, v, reweighting.build(name), mask=mask, is_causal=True)
    out.sum().backward()
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_reweighted_attention_equals_timm_attention():
    torch.manual_seed(0)
    timm_attn = TimmAttention(32, num_heads=4, qkv_bias=True).eval()
    ours = ReweightedAttention(32, num_heads=4, qkv_bias=True).eval()
    ours.load_state_dict(timm_attn.state_dict())  # same parameters, so timm weights load
    x = torch.randn(2, 7, 32)
    torch.testing.assert_close(ours(x), timm_attn(x))
    mask = torch.rand(2, 1, 7, 7) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(ours(x, attn_mask=mask), timm_attn(x, attn_mask=mask))
    with pytest.raises(TypeError, match="boolean attn_mask"):
        ours(x, attn_mask=mask.float())


@pytest.mark.parametrize("shape", [(7,), (1, 7), (1, 1, 7), (2, 1, 1, 7), (1, 1, 1, 7)])
def test_key_padding_forms_are_recognised(shape):
    mask = torch.rand(shape) > 0.5
    padding = key_padding_of(mask, 2, 7)
    assert padding.shape == (2, 7)
    assert torch.equal(padding.reshape(2, 1, 1, 7), mask.reshape(-1, 1, 1, 7).expand(2, 1, 1, 7))


@pytest.mark.parametrize("shape", [(2, 3, 1, 7), (2, 1, 5, 7), (2, 1, 1, 1), (2, 1, 7)])
def test_other_masks_are_not_key_padding(shape):
    assert key_padding_of(torch.ones(shape, dtype=torch.bool), 2, 7) is None


@pytest.mark.parametrize("mask_kind", ["none", "padding", "general"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_triton_backend_matches_reference(mask_kind, is_causal):
    """Fused attention (no mask, key padding) and the row-wise kernel (a general mask) agree with
    the reference path, gradients of q, k, v and the MultiMax parameters included."""
    q, k, v = (t.float() for t in qkv(B=2, H=2, Tq=9, Tk=9, D=16))
    masks = {
        "none": None,
        "padding": torch.tensor([[True] * 9, [True] * 5 + [False] * 4]).reshape(2, 1, 1, 9),
        "general": torch.rand(2, 2, 9, 9) > 0.3,
    }
    mask = masks[mask_kind]
    module = MultiMax(order=2)
    with torch.no_grad():
        module.ranges.copy_(torch.tensor([-0.5, 0.6, -1.0, 1.2]))
        module.ts.copy_(torch.tensor([0.3, 0.25, 0.1, 0.05]))
    outputs, grads = {}, {}
    for backend in ("reference", "triton"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        module.zero_grad()
        out = attention(*leaves, module, mask=mask, is_causal=is_causal, backend=backend)
        out.pow(2).sum().backward()
        outputs[backend] = out
        grads[backend] = [t.grad for t in leaves] + [module.ranges.grad.clone(), module.ts.grad.clone()]
    torch.testing.assert_close(outputs["triton"], outputs["reference"], atol=1e-5, rtol=1e-4)
    for g_fused, g_ref in zip(grads["triton"], grads["reference"]):
        torch.testing.assert_close(g_fused, g_ref, atol=1e-5, rtol=1e-3)


def test_triton_backend_takes_an_empty_batch():
    q, k, v = (t.float()[:0].requires_grad_() for t in qkv(B=2, H=2, Tq=9, Tk=9, D=16))
    out = attention(q, k, v, MultiMax(), is_causal=True, backend="triton")
    out.sum().backward()
    assert out.shape == (0, 2, 9, 16) and q.grad.shape == q.shape
