"""check_checkpoint_matches: a checkpoint of another model or config is refused with what differs."""

import pytest
import torch

from mmlight.models import TransformerConfig
from mmlight.tasks import LanguageModel
from mmlight.tasks.checkpoint import check_checkpoint_matches
from tests.helpers.models import micro_vit


def lm(d_model=8, n_layers=1, **task) -> LanguageModel:
    return LanguageModel(
        TransformerConfig(vocab_size=11, d_model=d_model, n_heads=2, ffn_dim=8, n_layers=n_layers), **task
    )


def checkpoint_of(module) -> dict:
    return {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}


def test_a_matching_checkpoint_passes():
    module = lm()
    check_checkpoint_matches(module, checkpoint_of(lm()))
    module.on_load_checkpoint(checkpoint_of(lm(lr=1e-3)))  # other hyperparameters, same shapes: fine


PREFIX = "the checkpoint was written by another model or config: "
# a decoder layer holds 16 tensors: q, k, v, out projections (weight, bias), 2 LayerNorms, 2 FFN linears
LAYER_1 = (
    "['model.decoder.layers.1.attn_block.norm.bias', 'model.decoder.layers.1.attn_block.norm.weight', "
    "'model.decoder.layers.1.ffn.fc1.bias']"
)


def refusal(ours, theirs) -> str:
    with pytest.raises(ValueError) as info:
        ours.on_load_checkpoint(checkpoint_of(theirs))
    return str(info.value)


def test_missing_unexpected_and_reshaped_parameters_are_named():
    hint = " Hyperparameters that differ: ['model']."
    assert refusal(lm(n_layers=2), lm(n_layers=1)) == (
        f"{PREFIX}16 parameter(s) missing from the checkpoint, e.g. {LAYER_1}.{hint}"
    )
    assert refusal(lm(n_layers=1), lm(n_layers=2)) == f"{PREFIX}16 unknown to this model, e.g. {LAYER_1}.{hint}"
    assert refusal(lm(), lm(d_model=16)) == (
        f"{PREFIX}shapes differ: model.decoder.embed.tokens.weight (11, 16) vs (11, 8), "
        "model.decoder.layers.0.attn_block.norm.bias (16,) vs (8,), "
        f"model.decoder.layers.0.attn_block.norm.weight (16,) vs (8,).{hint}"
    )


def test_counts_and_hint_in_the_message():
    module = lm()
    theirs = checkpoint_of(module)
    theirs["state_dict"] = dict(theirs["state_dict"])
    extra = {f"model.extra{i}": torch.zeros(1) for i in range(4)}
    theirs["state_dict"].update(extra)
    with pytest.raises(ValueError) as info:
        check_checkpoint_matches(module, theirs)
    message = str(info.value)
    assert "4 unknown to this model, e.g. ['model.extra0', 'model.extra1', 'model.extra2']." in message
    assert "Hyperparameters" not in message  # same hyperparameters: no hint
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        check_checkpoint_matches(module, {})  # no state_dict at all


def test_the_classifier_checks_too():
    from mmlight.tasks import ImageClassifier

    def classifier(num_classes):
        return ImageClassifier(micro_vit(num_classes=num_classes))

    classifier(3).on_load_checkpoint(checkpoint_of(classifier(3)))
    with pytest.raises(ValueError, match=r"^the checkpoint .* shapes differ: model.vit.head.bias \(4,\) vs \(3,\)"):
        classifier(3).on_load_checkpoint(checkpoint_of(classifier(4)))


def test_hyperparameters_on_one_side_only_are_named_and_problems_are_joined_by_semicolons():
    """A hyperparameter that only the checkpoint (or only the model) has differs too; two kinds of
    problem are listed in one sentence, separated by "; "; without differing hyperparameters the
    message ends at the full stop."""
    module = lm()
    theirs = checkpoint_of(module)
    theirs["state_dict"] = dict(theirs["state_dict"], **{"model.extra": torch.zeros(1)})
    theirs["state_dict"].pop("model.decoder.layers.0.ffn.fc1.bias")
    theirs["hyper_parameters"] = dict(theirs["hyper_parameters"], old_option=3)
    with pytest.raises(ValueError) as info:
        check_checkpoint_matches(module, theirs)
    assert str(info.value) == (
        f"{PREFIX}1 parameter(s) missing from the checkpoint, e.g. ['model.decoder.layers.0.ffn.fc1.bias']; "
        "1 unknown to this model, e.g. ['model.extra']. Hyperparameters that differ: ['old_option']."
    )
    theirs["hyper_parameters"].pop("old_option")
    with pytest.raises(ValueError) as info:
        check_checkpoint_matches(module, theirs)
    assert str(info.value).endswith("e.g. ['model.extra'].")
