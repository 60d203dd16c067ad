"""Starting a ReweightedViT from pretrained weights, checked against timm's own model and loader.

No weights can be downloaded here, so a randomly initialised (and perturbed, so that no norm sits at
its default) ``timm.create_model("deit_tiny_patch16_224")`` saved to a file stands in for them.
"""

import re
from pathlib import PurePosixPath

import pytest
import safetensors.torch
import timm
import torch
from timm.models.vision_transformer import VisionTransformer

from mmlight.models import ReweightedViT, ReweightingSpec, ViTConfig
from mmlight.models.pretrained import LoadReport, PretrainedMismatch, architecture_of, load_pretrained, read_pretrained

TIMM_NAME = "deit_tiny_patch16_224"
IDENTITY = ReweightingSpec("multimax", {"order": 2, "init_std": 0})


@pytest.fixture(scope="module")
def timm_state():
    torch.manual_seed(0)
    model = timm.create_model(TIMM_NAME)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def weights_file(timm_state, tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "deit_tiny.safetensors"
    safetensors.torch.save_file(timm_state, str(path))
    return path


def deit_tiny(pretrained, **kwargs) -> ViTConfig:
    options = dict(
        variant="deit_tiny",
        num_classes=1000,
        global_pool="token",
        drop_path_rate=0.0,
        attention=IDENTITY,
        backend="reference",
        pretrained=str(pretrained),
    )
    return ViTConfig(**{**options, **kwargs})


def images(size=224, n=2):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def timm_reference(state, **kwargs):
    model = timm.create_model(TIMM_NAME, **kwargs)
    model.load_state_dict(state)
    return model.double().eval()


@pytest.mark.parametrize("output_multimax", [False, True])
def test_identity_multimax_is_the_pretrained_model(timm_state, weights_file, output_multimax):
    """MultiMax with init_std 0 in every layer (and on the logits): timm's logits, to float64 rounding."""
    model = ReweightedViT(deit_tiny(weights_file, output_multimax=output_multimax, output_multimax_init_std=0))
    assert model.pretrained_report.dropped == {}
    assert all(".reweight." in key for key in model.pretrained_report.new) and len(model.pretrained_report.new) == 24
    x = images()
    with torch.no_grad():
        got = model.double().eval()(x)
        want = timm_reference(timm_state)(x)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_official_deit_file_with_weights_under_model(timm_state, tmp_path):
    """The official DeiT releases are ``{"model": state_dict}`` in a .pth."""
    path = tmp_path / "deit_tiny_patch16_224-a1311bcf.pth"
    torch.save({"model": timm_state}, path)
    model = ReweightedViT(deit_tiny(path)).double().eval()
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), timm_reference(timm_state)(x), atol=1e-10, rtol=1e-10)


def test_new_head_and_resized_position_embedding_match_timm_loader(timm_state, weights_file):
    """Another class count and image size: the features equal those of timm's own pretrained loading
    (``create_model(..., pretrained=True, num_classes=10, img_size=112)``), and the old head is dropped."""
    model = ReweightedViT(deit_tiny(weights_file, num_classes=10, img_size=112)).double().eval()
    assert set(model.pretrained_report.dropped) == {"head.weight", "head.bias"}
    assert model.vit.head.weight.shape == (10, 192) and model.vit.pos_embed.shape == (1, 1 + 7 * 7, 192)
    reference = (
        timm.create_model(
            TIMM_NAME, pretrained=True, num_classes=10, img_size=112, pretrained_cfg_overlay={"file": str(weights_file)}
        )
        .double()
        .eval()
    )
    torch.testing.assert_close(model.vit.pos_embed, reference.pos_embed, atol=0, rtol=0)
    x = images(112)
    with torch.no_grad():
        got = model.vit.forward_head(model.vit.forward_features(x), pre_logits=True)
        want = reference.forward_head(reference.forward_features(x), pre_logits=True)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_average_pooling_keeps_the_pretrained_norm(timm_state, weights_file):
    """A GAP head on DeiT weights: the CLS token is kept (the weights have one) and the final norm
    stays where the weights trained it, before the pooling (timm's ``fc_norm=False``)."""
    model = ReweightedViT(deit_tiny(weights_file, global_pool="avg")).double().eval()
    reference = timm.create_model(TIMM_NAME, global_pool="avg", fc_norm=False)
    reference.load_state_dict(timm_state)
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference.double().eval()(x), atol=1e-10, rtol=1e-10)


def test_sparsemax_loads_but_changes_the_model(timm_state, weights_file):
    """Functions that cannot be softmax at step 0 still load; their first forward differs."""
    model = ReweightedViT(deit_tiny(weights_file, attention=ReweightingSpec("sparsemax"))).double().eval()
    x = images()
    with torch.no_grad():
        got = model(x)
        want = timm_reference(timm_state)(x)
    assert torch.equal(model.vit.blocks[5].attn.qkv.weight.detach(), timm_state["blocks.5.attn.qkv.weight"].double())
    assert not torch.allclose(got, want, atol=1e-3)


def test_another_width_is_named(weights_file):
    with pytest.raises(PretrainedMismatch) as refused:
        ReweightedViT(deit_tiny(weights_file, variant="deit_small"))
    assert str(refused.value) == (
        f"the pretrained weights {weights_file} are another architecture: width 192, 12 blocks; "
        "model.variant deit_small has width 384, 12 blocks (fitting: deit_tiny)"
    )


def test_weights_with_a_norm_after_the_pooling_keep_it_there(tmp_path):
    """Weights of an average-pooled ViT trained with timm's ``fc_norm`` (the norm after the pooling, as
    MAE fine-tunes): the model takes that layout from the weights and gives timm's output."""
    torch.manual_seed(0)
    options = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=64, depth=4, num_heads=4)
    reference = VisionTransformer(**options, global_pool="avg", class_token=False, fc_norm=True).double().eval()
    assert "fc_norm.weight" in reference.state_dict() and "norm.weight" not in reference.state_dict()
    torch.save(reference.state_dict(), tmp_path / "mae_like.pth")
    config = ViTConfig(
        variant="vit_micro", img_size=8, patch_size=2, in_chans=1, num_classes=10, drop_path_rate=0.0,
        attention=IDENTITY, backend="reference", pretrained=str(tmp_path / "mae_like.pth"),
    )  # fmt: skip
    model = ReweightedViT(config).double().eval()
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))


def test_weights_of_no_known_variant_say_so_whole():
    from mmlight.models.vit import _check_variant

    with pytest.raises(PretrainedMismatch) as refused:
        _check_variant("deit_tiny", (100, 3), "in w.pth")
    assert str(refused.value) == (
        "the pretrained weights in w.pth are another architecture: width 100, 3 blocks; "
        "model.variant deit_tiny has width 192, 12 blocks (fitting: none of the variants)"
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda s: s.update(dist_token=torch.zeros(1, 1, 192), **{"head_dist.weight": torch.zeros(1000, 192)}),
            r"unexpected: dist_token, head_dist.weight",
        ),
        (lambda s: s.pop("blocks.3.mlp.fc1.weight"), r"missing: blocks.3.mlp.fc1.weight"),
        (
            lambda s: s.update({"blocks.0.mlp.fc1.weight": torch.zeros(384, 192)}),
            r"different shape \(weights vs model\): blocks.0.mlp.fc1.weight \(384, 192\) vs \(768, 192\)",
        ),
    ],
)
def test_mismatched_keys_are_named(timm_state, tmp_path, edit, message):
    state = dict(timm_state)
    edit(state)
    path = tmp_path / "edited.pth"
    torch.save(state, path)
    with pytest.raises(PretrainedMismatch, match=message):
        ReweightedViT(deit_tiny(path))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        ReweightedViT(deit_tiny(tmp_path / "nowhere.safetensors"))


def test_timm_name_offline_without_cache_is_a_clear_error(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError) as refused:
        ReweightedViT(deit_tiny(f"timm:{TIMM_NAME}"))
    assert re.fullmatch(
        rf"timm could not get the weights of '{TIMM_NAME}': they are not in the Hugging Face cache "
        rf"\({re.escape(str(tmp_path))}\) and the hub could not be reached or has no such weights "
        rf"\({type(refused.value.__cause__).__name__}: .*\)\. On a machine with access, run "
        rf"`python -c \"import timm; timm.create_model\('{TIMM_NAME}', pretrained=True\)\"` to fill the cache "
        r"\(set HF_HOME to share it\), or save the weights to a file and give its path as `pretrained`\.",
        str(refused.value),
        flags=re.DOTALL,
    )
    assert type(refused.value.__cause__).__name__ != "NoneType"


def test_unknown_timm_name():
    with pytest.raises(ValueError, match="timm has no model 'deit_nano'"):
        ReweightedViT(deit_tiny("timm:deit_nano"))


def test_timm_name_from_the_cache_offline(monkeypatch, tmp_path, timm_state):
    """Weights in the Hugging Face cache load with no network, as ``timm.create_model(name, pretrained=True)``."""
    from huggingface_hub import constants

    repo = tmp_path / "models--timm--deit_tiny_patch16_224.fb_in1k"
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision).mkdir(parents=True)
    safetensors.torch.save_file(timm_state, str(repo / "snapshots" / revision / "model.safetensors"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    tagged = read_pretrained(f"timm:{TIMM_NAME}.fb_in1k")  # a name with its pretrained tag, as timm lists them
    assert all(torch.equal(tagged[k], v) for k, v in timm_state.items())
    model = ReweightedViT(deit_tiny(f"timm:{TIMM_NAME}")).double().eval()
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), timm_reference(timm_state)(x), atol=1e-10, rtol=1e-10)


def test_the_summary_names_what_was_dropped_and_what_is_new(weights_file):
    report = ReweightedViT(deit_tiny(weights_file, num_classes=10, img_size=112)).pretrained_report
    assert report.summary() == (
        f"pretrained weights {weights_file}: dropped head.bias: shape (1000,) does not fit the new head (10,); "
        "head.weight: shape (1000, 192) does not fit the new head (10, 192); new (initialised here): "
        "blocks.0.attn.reweight.ranges, blocks.0.attn.reweight.ts, blocks.1.attn.reweight.ranges, "
        "blocks.1.attn.reweight.ts, blocks.10.attn.reweight.ranges, blocks.10.attn.reweight.ts ... (26 in all)"
    )


def test_pretrained_null_on_the_command_line_means_no_weights():
    """jsonargparse reads ``null`` for a nested ``str | None`` of a class-path model as the string
    "None"; the config maps it back, so a fine-tuning config can be run from scratch."""
    from jsonargparse import ArgumentParser

    from mmlight.tasks import ImageClassifier

    parser = ArgumentParser()
    parser.add_subclass_arguments(ImageClassifier, "model")
    args = ["--model", "mmlight.tasks.ImageClassifier", "--model.init_args.model.pretrained", "null"]
    args += ["--model.init_args.model.variant", "vit_micro", "--model.init_args.model.img_size", "8"]
    args += ["--model.init_args.model.patch_size", "2"]
    task = parser.instantiate_classes(parser.parse_args(args)).model
    assert task.model.config.pretrained is None
    assert ViTConfig(pretrained="None").pretrained is None and ViTConfig(pretrained="w.pth").pretrained == "w.pth"
    assert ViTConfig(pretrained="null").pretrained is None and ViTConfig(pretrained="").pretrained is None


def test_an_mmlight_checkpoint_is_read_by_its_vit_weights(timm_state, tmp_path):
    """A Lightning checkpoint of an ImageClassifier (``model.vit.*`` in ``state_dict``, other entries beside) is
    read as the timm weights under that prefix; one without them is named."""
    path = tmp_path / "last.ckpt"
    state = {f"model.vit.{k}": v for k, v in timm_state.items()} | {"model.other.weight": torch.zeros(1)}
    # a run's hyperparameters may hold a path, which the checkpoint reader admits besides tensors and containers
    # (objects of other types are refused: tests/test_safe_load.py)
    torch.save({"state_dict": state, "epoch": 3, "hyper_parameters": {"root": PurePosixPath("/data")}}, path)
    model = ReweightedViT(deit_tiny(path)).double().eval()
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), timm_reference(timm_state)(x), atol=1e-10, rtol=1e-10)
    for content in ({"state_dict": {"model.other.weight": torch.zeros(1)}}, {"epoch": 3}):  # no state_dict at all
        torch.save(content, path)
        with pytest.raises(PretrainedMismatch) as refused:
            read_pretrained(str(path))
        assert str(refused.value) == f"{path} holds no ImageClassifier weights (no 'model.vit.*' keys)"


def test_a_file_with_ema_weights_gives_the_ema_weights(timm_state, tmp_path):
    """Official DeiT files keep ``model`` and ``model_ema``: the EMA weights are read, as timm reads them."""
    path = tmp_path / "deit.pth"
    ema = {k: v + 1 for k, v in timm_state.items()}
    torch.save({"model": timm_state, "model_ema": ema}, path)
    read = read_pretrained(str(path))
    assert read.keys() == ema.keys() and all(torch.equal(read[k], ema[k]) for k in ema)


def test_architecture_of_reads_width_and_depth_and_names_a_state_that_is_no_vit():
    patch = {"patch_embed.proj.weight": torch.zeros(192, 3, 16, 16)}
    assert architecture_of(patch) == (192, 0)  # no block
    assert architecture_of(patch | {"blocks.0.norm1.weight": torch.zeros(1), "blocks.11.mlp.fc1.bias": 0}) == (192, 12)
    few = {f"k{i}": torch.zeros(1) for i in range(5)}
    with pytest.raises(PretrainedMismatch) as refused:
        architecture_of(few)
    assert str(refused.value) == (
        "the weights are not a timm VisionTransformer: no 'patch_embed.proj.weight' among k0, k1, k2, k3, k4"
    )
    with pytest.raises(PretrainedMismatch) as refused:
        architecture_of(few | {"k5": torch.zeros(1)})
    assert str(refused.value).endswith("among k0, k1, k2, k3, k4 ...")


def test_a_mismatch_lists_at_most_eight_keys_of_each_kind(timm_state, tmp_path):
    """Eight missing keys are listed whole, nine with an ellipsis; the kinds are joined by '; '."""
    names = sorted(k for k in timm_state if k.startswith("blocks.1.") or k.startswith("blocks.2."))
    for cut, tail in ((8, ""), (9, " ...")):
        state = {k: v for k, v in timm_state.items() if k not in names[:cut]} | {"extra": torch.zeros(1)}
        path = tmp_path / f"cut{cut}.pth"
        torch.save(state, path)
        with pytest.raises(PretrainedMismatch) as refused:
            ReweightedViT(deit_tiny(path))
        assert str(refused.value) == (
            f"the pretrained weights {path} do not fit the model: missing: {', '.join(sorted(names[:cut])[:8])}"
            f"{tail}; unexpected: extra. Pick the variant, image size, patch size and class_token of the weights' "
            "architecture."
        )


def test_a_model_without_a_head_drops_the_pretrained_head(timm_state):
    """``num_classes=0`` (a feature extractor): the pretrained classifier is dropped, each key with its reason."""
    vit = timm.create_model(TIMM_NAME, num_classes=0)
    report = load_pretrained(vit, dict(timm_state), "w.pth", set())
    assert report.dropped == {
        "head.bias": "shape (1000,); the model has no head.bias",
        "head.weight": "shape (1000, 192); the model has no head.weight",
    }
    assert report.new == [] and torch.equal(vit.state_dict()["cls_token"], timm_state["cls_token"])


@pytest.mark.parametrize(
    "dropped, new, text",
    [
        ({}, [], "dropped none; new (initialised here): none"),
        (
            {"head.bias": "why"},
            [f"n{i}" for i in range(6)],
            "dropped head.bias: why; new (initialised here): n0, n1, n2, n3, n4, n5",
        ),
        (
            {},
            [f"n{i}" for i in range(7)],
            "dropped none; new (initialised here): n0, n1, n2, n3, n4, n5 ... (7 in all)",
        ),
    ],
)
def test_the_summary_of_nothing_dropped_six_and_seven_new_keys(dropped, new, text):
    assert LoadReport("w.pth", dropped, new).summary() == f"pretrained weights w.pth: {text}"
