"""The timm-based ViT/DeiT with swappable reweighting."""

import copy

import pytest
import torch

from mmlight.models import ReweightedViT, ReweightingSpec, ViTConfig
from mmlight.reweighting import MultiMax
from tests.helpers.models import micro_vit


@pytest.mark.parametrize("variant, millions", [("deit_tiny", 5.7), ("deit_small", 22.1), ("deit_base", 86.6)])
def test_deit_sizes(variant, millions):
    """Parameter counts of DeiT-Ti/S/B (Touvron et al., 2021, Table 1), with the GAP head."""
    with torch.device("meta"):
        model = ReweightedViT(ViTConfig(variant=variant, attention=ReweightingSpec("multimax")))
    n = sum(p.numel() for p in model.parameters())
    assert n / 1e6 == pytest.approx(millions, abs=0.15)


def test_each_layer_gets_its_own_reweighting():
    model = ReweightedViT(micro_vit(attention=ReweightingSpec("multimax", {"order": 1})))
    sites = model.attention_sites()
    assert list(sites) == [f"blocks.{i}" for i in range(4)]
    assert [(s.name, s.kind, s.stack, s.layer, s.keys_from) for s in sites.values()] == [
        (f"blocks.{i}", "self", "blocks", i, "blocks") for i in range(4)
    ]
    layers = [s.module for s in sites.values()]
    assert all(sites[f"blocks.{i}"].module is model.vit.blocks[i].attn.reweight for i in range(4))
    assert len(layers) == 4 and all(isinstance(m, MultiMax) and m.order == 1 for m in layers)
    assert len({id(m.ts) for m in layers}) == 4
    assert model.output is None


def test_output_multimax_modulates_logits():
    model = ReweightedViT(micro_vit(output_multimax=True)).eval()
    images = torch.randn(3, 1, 8, 8)
    torch.testing.assert_close(model(images), model.output.modulate(model.vit(images)))


@pytest.mark.parametrize("pool, has_cls", [("avg", False), ("token", True)])
def test_head_pooling(pool, has_cls):
    model = ReweightedViT(micro_vit(global_pool=pool))
    assert (model.vit.cls_token is not None) == has_cls
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    # the blocks' records: a CLS token is a prefix that the token similarity leaves out
    assert [(b.name, b.stack, b.layer, b.prefix) for b in model.blocks()] == [
        (f"blocks.{i}", "blocks", i, int(has_cls)) for i in range(4)
    ]
    assert all(b.module is model.vit.blocks[b.layer] for b in model.blocks())


def test_softmax_model_uses_fused_path(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    ReweightedViT(micro_vit())(torch.randn(2, 1, 8, 8))
    assert len(calls) == 4
    calls.clear()
    ReweightedViT(micro_vit(attention=ReweightingSpec("sparsemax")))(torch.randn(2, 1, 8, 8))
    assert calls == []


def test_unknown_option_fails_at_construction():
    with pytest.raises(ValueError, match="orderr"):
        ReweightedViT(micro_vit(attention=ReweightingSpec("multimax", {"orderr": 2})))


def test_bf16_forward_backward():
    model = ReweightedViT(micro_vit(attention=ReweightingSpec("multimax"), output_multimax=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 1, 8, 8)).float().logsumexp(-1).mean()
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_triton_backend_equals_reference():
    """The config's backend key reaches every layer; fused attention and fused cross-entropy give
    the reference model's logits, loss and gradients (Triton interpreter on the CPU)."""
    spec = ReweightingSpec("multimax", {"order": 2})
    ref = ReweightedViT(micro_vit(attention=spec, output_multimax=True, drop_path_rate=0.0, backend="reference"))
    fused = ReweightedViT(micro_vit(attention=spec, output_multimax=True, drop_path_rate=0.0, backend="triton"))
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
        ReweightedViT(micro_vit(attention=ReweightingSpec("multimax", {"backend": "triton"})))


def test_config_defaults_are_the_deit_small_recipe():
    c = ViTConfig()
    assert (c.variant, c.img_size, c.patch_size, c.in_chans, c.num_classes) == ("deit_small", 224, 16, 3, 1000)
    assert (c.global_pool, c.drop_path_rate, c.output_multimax, c.output_multimax_order, c.backend) == (
        "avg",
        0.1,
        False,
        2,
        "auto",
    )
    assert c.attention == ReweightingSpec("softmax", {})


@pytest.mark.parametrize(
    "variant, width, depth, heads",
    [("deit_tiny", 192, 12, 3), ("deit_small", 384, 12, 6), ("deit_base", 768, 12, 12), ("vit_micro", 64, 4, 4)],
)
def test_variant_width_depth_heads(variant, width, depth, heads):
    with torch.device("meta"):
        model = ReweightedViT(ViTConfig(variant=variant))
    assert (model.vit.embed_dim, len(model.vit.blocks), model.vit.blocks[0].attn.num_heads) == (width, depth, heads)


def test_the_config_reaches_timm():
    model = ReweightedViT(
        ViTConfig(
            variant="vit_micro",
            img_size=12,
            patch_size=4,
            in_chans=2,
            num_classes=5,
            drop_path_rate=0.3,
            backend="compile",
            output_multimax=True,
            output_multimax_order=1,
            attention=ReweightingSpec("multimax", {"order": 1}),
        )
    )
    vit = model.vit
    assert tuple(vit.patch_embed.img_size) == (12, 12) and tuple(vit.patch_embed.patch_size) == (4, 4)
    assert vit.patch_embed.proj.in_channels == 2 and vit.head.out_features == 5
    assert vit.global_pool == "avg" and vit.cls_token is None
    # stochastic depth rises linearly to drop_path_rate at the last block
    assert vit.blocks[-1].drop_path1.drop_prob == pytest.approx(0.3) and vit.blocks[
        1
    ].drop_path1.drop_prob == pytest.approx(0.1)
    assert all(s.module.backend == "compile" for s in model.attention_sites().values())
    assert (model.output.order, model.output.backend) == (1, "compile")
    assert (
        model.no_weight_decay() == {f"vit.{name}" for name in vit.no_weight_decay()}
        and "vit.pos_embed" in model.no_weight_decay()
    )


@pytest.mark.parametrize("output_multimax", [False, True])
def test_loss_is_cross_entropy_of_the_returned_scores(output_multimax):
    model = ReweightedViT(micro_vit(output_multimax=output_multimax, drop_path_rate=0.0)).eval()
    if output_multimax:
        with torch.no_grad():
            model.output.ts.uniform_(-0.5, 0.5)
    images, labels = torch.randn(4, 1, 8, 8), torch.tensor([1, 7, 3, 3])
    for smoothing in (0.0, 0.2):
        want = torch.nn.functional.cross_entropy(model(images).double(), labels, label_smoothing=smoothing)
        assert model.loss(images, labels, label_smoothing=smoothing).item() == pytest.approx(want.item(), rel=1e-5)
        if smoothing == 0.0:  # the default is no smoothing
            assert model.loss(images, labels).item() == pytest.approx(want.item(), rel=1e-5)


def test_config_is_kept_and_the_output_multimax_is_a_named_site():
    config = micro_vit(output_multimax=True, output_multimax_order=1, output_multimax_terms="low")
    model = ReweightedViT(config)
    assert model.config is config
    assert (model.output.order, model.output.terms) == (1, "low")
    sites = model.reweighting_sites()
    assert list(sites) == [f"blocks.{i}" for i in range(4)] + ["output"] and sites["output"] is model.output
    assert list(ReweightedViT(micro_vit()).reweighting_sites()) == [f"blocks.{i}" for i in range(4)]


def test_a_class_token_is_added_when_asked_and_token_pooling_refuses_to_go_without():
    assert ReweightedViT(micro_vit(global_pool="avg", class_token=True)).vit.cls_token.shape == (1, 1, 64)
    assert ReweightedViT(micro_vit(global_pool="avg", class_token=False)).vit.cls_token is None
    with pytest.raises(ValueError) as refused:
        ReweightedViT(micro_vit(global_pool="token", class_token=False))
    assert str(refused.value) == "global_pool: token needs class_token: true (or null)"


@pytest.mark.parametrize("pool", ["avg", "token"])
def test_layer_ids_count_depth_as_beit_does(pool):
    """Reference, from the parameter names alone: the stem (patch embedding, position embedding, CLS token)
    is layer 0, ``blocks.<i>.`` is ``i + 1``, and what comes after the last of the 4 blocks (final norm,
    head, output MultiMax) is 5."""
    model = ReweightedViT(micro_vit(global_pool=pool, output_multimax=True))

    def expected(name: str) -> int:
        if name.startswith(("vit.patch_embed.", "vit.pos_embed", "vit.cls_token")):
            return 0
        if name.startswith("vit.blocks."):
            return int(name.split(".")[2]) + 1
        return 5

    ids = model.layer_ids()
    names = [name for name, _ in model.named_parameters()]
    assert sorted(ids) == sorted(names)
    assert ids == {name: expected(name) for name in names}
    assert ("vit.cls_token" in ids) == (pool == "token")
    assert {ids[n] for n in names if n.startswith("output.") or n.startswith("vit.head.")} == {5}


def test_each_layer_is_built_as_a_non_causal_site_with_the_model_s_heads():
    """A per-head function learns one value per head of the variant (vit_micro: 4); a causal-only one is
    refused, naming the ViT's attention."""
    model = ReweightedViT(micro_vit(attention=ReweightingSpec("ssmax")))
    assert [tuple(block.attn.reweight.s.shape) for block in model.vit.blocks] == [(4,)] * 4
    with pytest.raises(ValueError) as refused:
        ReweightedViT(micro_vit(attention=ReweightingSpec("stickbreaking")))
    assert str(refused.value) == (
        "reweighting 'stickbreaking' attends only to earlier keys and needs causal attention; "
        "the ViT self-attention is not causal (use it in decoder self-attention only)"
    )


def layer_norm_copies(model: ReweightedViT, images: torch.Tensor, labels: torch.Tensor) -> int:
    """Copies that LayerNorm makes of a non-contiguous input (forward) or gradient (backward) in one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.loss(images, labels).backward()
    norms = ("aten::native_layer_norm", "aten::native_layer_norm_backward")

    def in_a_norm(event) -> bool:  # clone <- contiguous <- native_layer_norm(_backward)
        parent = event.cpu_parent
        if parent is None or parent.name != "aten::contiguous":
            return False
        return parent.cpu_parent is not None and parent.cpu_parent.name in norms

    return sum(1 for event in prof.events() if event.name == "aten::clone" and in_a_norm(event))


@pytest.mark.parametrize("pool", ["avg", "token"])
def test_tokens_are_contiguous_and_the_values_are_timms(pool):
    """The residual stream leaves the patch embedding contiguous, so no LayerNorm copies it (timm's
    own embedding leaves it (B, C, N)-strided without a class token: 4 copies per block and step). The
    loss equals that of the same weights with timm's embedding bit for bit; each gradient is within 1e-5
    of its largest entry (84 fp32 ulps), since a parameter's gradient sums over the batch and the tokens
    in an order that follows the layout and the threads (measured: up to 1.2e-6 with 2 threads)."""
    from timm.layers import PatchEmbed

    torch.manual_seed(0)
    model = ReweightedViT(micro_vit(global_pool=pool, drop_path_rate=0.0, output_multimax=True))
    stock = copy.deepcopy(model)
    stock.vit.patch_embed.__class__ = PatchEmbed  # the same parameters through timm's forward
    images, labels = torch.randn(3, 1, 8, 8), torch.tensor([1, 4, 9])
    depth = len(model.vit.blocks)
    assert layer_norm_copies(model, images, labels) == 0
    assert layer_norm_copies(stock, images, labels) == (0 if pool == "token" else 4 * depth)
    for network in (model, stock):
        network.zero_grad()
        network.loss(images, labels).backward()
    assert torch.equal(model.loss(images, labels), stock.loss(images, labels))
    for (name, mine), (_, timms) in zip(model.named_parameters(), stock.named_parameters()):
        assert (mine.grad - timms.grad).abs().max() <= 1e-5 * timms.grad.abs().max(), name
