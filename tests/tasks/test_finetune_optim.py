"""Fine-tuning options of ImageClassifier: per-part learning rates, layer-wise decay and a frozen
backbone, checked on the optimiser that training actually built and on its state."""

import logging

import lightning as L
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer
from timm.optim._param_groups import param_groups_layer_decay

from mmlight.data import DigitsDataModule, write_digits_shards
from mmlight.models import ReweightingSpec
from mmlight.tasks import ImageClassifier
from tests.helpers.models import micro_vit
from tests.helpers.trainer import quiet_trainer

MICRO = micro_vit(
    global_pool="token",
    attention=ReweightingSpec("multimax", {"init_std": 0}),
    output_multimax=True,
    drop_path_rate=0.0,
)
LR = 1e-3


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    write_digits_shards(root)
    return root


def fit(module, digits, epochs=1, batches=2):
    trainer = quiet_trainer(max_epochs=epochs, limit_train_batches=batches, limit_val_batches=0)
    trainer.fit(module, DigitsDataModule(cache_dir=str(digits), batch_size=16))
    return trainer.optimizers[0]


def lr_of(optimizer, module) -> dict[str, float]:
    """Each parameter's peak learning rate, as the optimiser holds it."""
    names = {id(p): name for name, p in module.model.named_parameters()}
    return {names[id(p)]: group["initial_lr"] for group in optimizer.param_groups for p in group["params"]}


def reweighting_names(module) -> set[str]:
    return {name for name, _ in module.model.named_parameters() if ".reweight." in name or name.startswith("output.")}


def test_head_and_reweighting_learning_rates(digits):
    module = ImageClassifier(
        MICRO, lr=LR, lr_reference_batch=None, head_lr_mult=10, reweighting_lr_mult=100, warmup_epochs=0
    )
    lrs = lr_of(fit(module, digits), module)
    assert set(lrs) == {name for name, _ in module.model.named_parameters()}
    reweighting = reweighting_names(module)
    assert len(reweighting) == 2 * 4 + 2  # ranges and ts in 4 blocks and on the logits
    for name, lr in lrs.items():
        want = 100 * LR if name in reweighting else 10 * LR if name.startswith("vit.head.") else LR
        assert lr == pytest.approx(want), name


def test_layer_decay_matches_timm_and_beit_formula(digits):
    """Each backbone parameter's learning rate is the peak x decay ** (depth + 1 - layer) (MAE's
    ``lr_decay.py``, BEiT's ``get_layer_id_for_vit``), the scale that timm's own
    ``param_groups_layer_decay`` gives the same VisionTransformer, except for the final norm: BEiT
    and MAE put it at the top with the head (scale 1), timm with the last block."""
    decay = 0.5
    module = ImageClassifier(MICRO, lr=LR, lr_reference_batch=None, layer_decay=decay, warmup_epochs=0)
    lrs = lr_of(fit(module, digits), module)
    plain = VisionTransformer(
        img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=64, depth=4, num_heads=4, global_pool="token"
    )
    timm_scale = {
        f"vit.{name}": group["lr_scale"]
        for group in param_groups_layer_decay(plain, layer_decay=decay)
        for name, p in plain.named_parameters()
        if any(p is q for q in group["params"])
    }
    by_hand = {
        "vit.patch_embed.proj.weight": decay**5,
        "vit.cls_token": decay**5,
        "vit.pos_embed": decay**5,
        "vit.blocks.0.attn.qkv.weight": decay**4,
        "vit.blocks.3.mlp.fc2.bias": decay**1,
        "vit.norm.weight": 1.0,
        "vit.head.weight": 1.0,
    }
    for name, scale in by_hand.items():
        assert lrs[name] == pytest.approx(LR * scale), name
    reweighting = reweighting_names(module)
    top_norm = {"vit.norm.weight", "vit.norm.bias"}
    assert all(timm_scale[name] == decay for name in top_norm)
    for name, lr in lrs.items():
        want = LR if name in reweighting | top_norm else LR * timm_scale[name]
        assert lr == pytest.approx(want), name


class EpochEnds(L.Callback):
    """Each parameter's AdamW step count (None: no state) and weights at the end of every epoch."""

    def __init__(self):
        self.ends = []

    def on_train_epoch_end(self, trainer, module):
        state = trainer.optimizers[0].state
        self.ends.append(
            {
                name: (int(state[p]["step"]) if p in state else None, p.detach().clone())
                for name, p in module.model.named_parameters()
            }
        )


def test_frozen_backbone_is_left_alone_then_trains(digits):
    """One frozen epoch of 2 steps, then one free epoch: after epoch 0 the backbone has no AdamW state
    and its weights are unchanged; after epoch 1 its state counts 2 steps, the head's 4."""
    torch.manual_seed(0)
    module = ImageClassifier(MICRO, lr=LR, lr_reference_batch=None, warmup_epochs=0, freeze_backbone_epochs=1)
    start = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    record = EpochEnds()
    trainer = quiet_trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=0, callbacks=[record])
    trainer.fit(module, DigitsDataModule(cache_dir=str(digits), batch_size=16))
    names = {id(p): name for name, p in module.model.named_parameters()}
    backbone = {names[id(p)] for p in module.backbone_parameters()}
    assert backbone == set(names.values()) - reweighting_names(module) - {"vit.head.weight", "vit.head.bias"}
    for name, (step, weights) in record.ends[0].items():
        if name in backbone:
            assert step is None and torch.equal(weights, start[name]), name
        else:
            assert step == 2 and not torch.equal(weights, start[name]), name
    for name, (step, weights) in record.ends[1].items():
        assert step == (2 if name in backbone else 4) and not torch.equal(weights, start[name]), name


def test_freeze_counts_epochs_of_the_run(digits):
    """With two frozen epochs out of two, nothing of the backbone moves; the head does."""
    module = ImageClassifier(MICRO, lr=LR, lr_reference_batch=None, warmup_epochs=0, freeze_backbone_epochs=2)
    start = [p.detach().clone() for p in module.backbone_parameters()]
    optimizer = fit(module, digits, epochs=2)
    assert all(torch.equal(p.detach(), s) for p, s in zip(module.backbone_parameters(), start))
    assert int(optimizer.state[module.model.vit.head.weight]["step"]) == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layer_decay": 0.0}, "layer_decay must be in"),
        ({"layer_decay": 1.5}, "layer_decay must be in"),
        ({"head_lr_mult": -1.0}, "multipliers must be >= 0"),
        ({"freeze_backbone_epochs": -1}, "freeze_backbone_epochs"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ImageClassifier(MICRO, **kwargs)


def test_the_edges_of_the_options_are_accepted():
    """``layer_decay`` 1 (every layer at the peak rate), multipliers and frozen epochs of 0."""
    module = ImageClassifier(
        MICRO, layer_decay=1.0, head_lr_mult=0.0, reweighting_lr_mult=0.0, freeze_backbone_epochs=0
    )
    assert (module.hparams.layer_decay, module.hparams.head_lr_mult) == (1.0, 0.0)


def test_what_the_pretrained_weights_gave_is_logged_when_the_task_is_built(tmp_path, caplog):
    """The load report (what was dropped, what is new) is printed by rank zero through Lightning's logger, which
    the CLI shows (mmlight's own logger, where the loader also logs it, has no handler in a training run)."""
    torch.manual_seed(0)
    plain = VisionTransformer(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=64, depth=4, num_heads=4)
    torch.save(plain.state_dict(), tmp_path / "plain.pth")
    with caplog.at_level(logging.INFO):
        module = ImageClassifier(micro_vit(global_pool="token", pretrained=str(tmp_path / "plain.pth")))
    summary = module.model.pretrained_report.summary()
    lightning = [r.getMessage() for r in caplog.records if r.name.startswith("lightning")]
    assert "new" in summary and lightning == [summary]
