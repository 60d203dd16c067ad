"""Parameter groups and the warmup-cosine schedule."""

import math

import pytest
import torch

from mmlight.models import ReweightedViT, ReweightingSpec
from mmlight.reweighting import Reweighting
from mmlight.tasks.optim import param_groups, warmup_cosine
from tests.helpers.models import micro_vit
from tests.helpers.references import lrs


def test_no_decay_on_1d_pos_embed_and_reweighting():
    model = ReweightedViT(
        micro_vit(global_pool="token", attention=ReweightingSpec("softmax", {"learnable": True}), output_multimax=True)
    )
    decay, no_decay = param_groups(model, weight_decay=0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert {
        "vit.pos_embed",
        "vit.cls_token",
        "output.ranges",
        "output.ts",
        "vit.blocks.0.attn.reweight.log_temperature",
        "vit.blocks.0.attn.qkv.bias",
    } <= skipped
    assert {"vit.blocks.0.attn.qkv.weight", "vit.head.weight", "vit.patch_embed.proj.weight"} <= decayed
    assert all(model.get_parameter(n).ndim >= 2 for n in decayed)
    assert len(decayed) + len(skipped) == len(list(model.parameters()))


def test_warmup_cosine_values():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_cosine(opt, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    lrs = []
    for _ in range(15):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert lrs[14] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_cosine(opt, warmup_steps=20, total_steps=10)


def test_inverse_sqrt_with_one_warmup_step_and_refusing_none():
    from mmlight.tasks.optim import warmup_inverse_sqrt

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_inverse_sqrt(opt, warmup_steps=1)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0, math.sqrt(1 / 2), math.sqrt(1 / 3), 0.5])
    with pytest.raises(ValueError, match="^inverse_sqrt needs warmup_steps >= 1, got 0$"):
        warmup_inverse_sqrt(opt, warmup_steps=0)


class MixingReweighting(Reweighting):
    """A reweighting with a 2-D parameter: every reweighting parameter is kept from decay, not only
    the 1-D ones (decay would pull any of them toward plain softmax)."""

    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Parameter(torch.eye(3))


def test_every_reweighting_parameter_is_undecayed_and_frozen_parameters_are_left_out():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), MixingReweighting(), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)  # frozen first: the parameters after it still count
    decay, no_decay = param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in decay["params"]] == ["2.weight"]
    assert [names[id(p)] for p in no_decay["params"]] == ["1.mix", "2.bias"]


def lr_factors(warmup: int, total: int, steps: int, **kwargs) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return lrs(opt, warmup_cosine(opt, warmup_steps=warmup, total_steps=total, **kwargs), steps)


def test_warmup_cosine_edges():
    """No warm-up starts at the peak; the default floor is 0; a one-step decay goes from peak to floor."""
    assert lr_factors(0, 4, 5) == pytest.approx(
        [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 + 0.5 * math.cos(3 * math.pi / 4), 0.0]
    )
    # the warm-up reaches the peak at its last step; the cosine starts there (progress 0) and ends one later
    assert lr_factors(2, 3, 4, min_lr_ratio=0.2) == pytest.approx([0.5, 1.0, 1.0, 0.2])
    with pytest.raises(ValueError, match=r"^need 0 <= warmup_steps \(-1\) <= total_steps \(3\)$"):
        lr_factors(-1, 3, 1)


def test_full_rate_groups_come_first_even_empty_and_other_rates_follow_in_order_of_appearance():
    """The decayed and the not-decayed group at the full rate are always the first two (Lightning's
    LearningRateMonitor names its curves by group position, so they keep their names across configs), even
    when one is empty; groups at other rates follow in the order of their first parameter."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))  # 1-D norm; 2-D weight, 1-D bias
    groups = param_groups(model, 0.1, lambda name: 0.5 if name.startswith("0.") else 1.0)
    names = {id(p): name for name, p in model.named_parameters()}
    assert [(g["weight_decay"], g["lr_scale"], [names[id(p)] for p in g["params"]]) for g in groups] == [
        (0.1, 1.0, ["1.weight"]),
        (0.0, 1.0, ["1.bias"]),
        (0.0, 0.5, ["0.weight", "0.bias"]),
    ]
    only_norm = param_groups(torch.nn.LayerNorm(4), 0.1)
    assert [(g["weight_decay"], g["lr_scale"], len(g["params"])) for g in only_norm] == [(0.1, 1.0, 0), (0.0, 1.0, 2)]
