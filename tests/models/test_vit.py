"""The timm-based ViT/DeiT with swappable reweighting."""

import pytest
import torch

from mmlight.models import ReweightedViT, ReweightingSpec, ViTConfig
from mmlight.reweighting import MultiMax


@pytest.mark.parametrize("variant, millions", [("deit_tiny", 5.7), ("deit_small", 22.1), ("deit_base", 86.6)])
def test_deit_sizes(variant, millions):
    """Parameter counts of DeiT-Ti/S/B (Touvron et al., 2021, Table 1), with the GAP head."""
    with torch.device("meta"):
        model = ReweightedViT(ViTConfig(variant=variant, attention=ReweightingSpec("multimax")))
    n = sum(p.numel() for p in model.parameters())
    assert n / 1e6 == pytest.approx(millions, abs=0.15)


def micro(**kwargs):
    return ViTConfig(variant="vit_micro", img_size=8, patch_size=2, in_chans=1, num_classes=10, **kwargs)


def test_each_layer_gets_its_own_reweighting():
    model = ReweightedViT(micro(attention=ReweightingSpec("multimax", {"order": 1})))
    sites = model.attention_sites()
    assert list(sites) == [f"blocks.{i}" for i in range(4)]
    layers = list(sites.values())
    assert all(sites[f"blocks.{i}"] is model.vit.blocks[i].attn.reweight for i in range(4))
    assert len(layers) == 4 and all(isinstance(m, MultiMax) and m.order == 1 for m in layers)
    assert len({id(m.ts) for m in layers}) == 4
    assert model.output is None


def test_output_multimax_modulates_logits():
    model = ReweightedViT(micro(output_multimax=True)).eval()
    images = torch.randn(3, 1, 8, 8)
    torch.testing.assert_close(model(images), model.output.modulate(model.vit(images)))


@pytest.mark.parametrize("pool, has_cls", [("avg", False), ("token", True)])
def test_head_pooling(pool, has_cls):
    model = ReweightedViT(micro(global_pool=pool))
    assert (model.vit.cls_token is not None) == has_cls
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_softmax_model_uses_fused_path(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    ReweightedViT(micro())(torch.randn(2, 1, 8, 8))
    assert len(calls) == 4
    calls.clear()
    ReweightedViT(micro(attention=ReweightingSpec("sparsemax")))(torch.randn(2, 1, 8, 8))
    assert calls == []


def test_unknown_option_fails_at_construction():
    with pytest.raises(ValueError, match="orderr"):
        ReweightedViT(micro(attention=ReweightingSpec("multimax", {"orderr": 2})))


def test_bf16_forward_backward():
    model = ReweightedViT(micro(attention=ReweightingSpec("multimax"), output_multimax=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 1, 8, 8)).float().logsumexp(-1).mean()
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_triton_backend_equals_reference():
    """The config's backend key reaches every layer; fused attention and fused cross-entropy give
    the reference model's logits, loss and gradients (Triton interpreter on the CPU)."""
    spec = ReweightingSpec("multimax", {"order": 2})
    ref = ReweightedViT(micro(attention=spec, output_multimax=True, drop_path_rate=0.0, backend="reference"))
    fused = ReweightedViT(micro(attention=spec, output_multimax=True, drop_path_rate=0.0, backend="triton"))
    with torch.no_grad():  # bend sigma so the kernels' derivative terms matter
        for m in ref.reweighting_sites().values():
            m.ranges.copy_(torch.tensor([-0.5, 0.6, -1.0, 1.2]))
            m.ts.copy_(torch.tensor([0.3, 0.25, 0.1, 0.05]))
    fused.load_state_dict(ref.state_dict())
    assert {m.backend for m in fused.reweighting_sites().values()} == {"triton"}
    images, labels = torch.randn(3, 1, 8, 8), torch.tensor([1, 4, 7])
    torch.testing.assert_close(fused(images), ref(images), atol=1e-5, rtol=1e-4)
    ref.loss(images, labels, label_smoothing=0.1).backward()
    fused.loss(images, labels, label_smoothing=0.1).backward()
    for (name, p_ref), p_fused in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(p_fused.grad, p_ref.grad, atol=1e-5, rtol=1e-3, msg=name)


def test_backend_in_options_is_refused():
    with pytest.raises(ValueError, match="backend"):
        ReweightedViT(micro(attention=ReweightingSpec("multimax", {"backend": "triton"})))
