"""``ReweightingSpec.build`` (reweighting/spec.py): what a model's config entry turns into per layer."""

import pytest

from mmlight.reweighting import ReweightingSpec
from mmlight.reweighting.ssmax import SSMax


def test_build_passes_the_backend_and_the_head_count_and_keeps_the_options():
    module = ReweightingSpec("ssmax", {"learnable": False}).build(backend="compile", num_heads=3)
    assert isinstance(module, SSMax) and module.backend == "compile"
    assert module.s.shape == (3,) and not module.s.requires_grad
    assert ReweightingSpec("ssmax").build().s.shape == (1,)  # no head count: one shared value
    assert ReweightingSpec("ssmax").build().backend == "auto"
    # an explicit option wins over the layer's head count; a function without one ignores it
    assert ReweightingSpec("ssmax", {"num_heads": 1}).build(num_heads=4).s.shape == (1,)
    assert ReweightingSpec("softmax").build(num_heads=4).backend == "auto"


def test_a_backend_among_the_options_is_refused_with_where_it_belongs():
    with pytest.raises(
        ValueError, match=r"^set the backend with the model's `backend` key, not in the reweighting options$"
    ):
        ReweightingSpec("softmax", {"backend": "triton"}).build()


def test_a_causal_only_function_is_built_by_default_and_refused_for_a_non_causal_layer_by_its_name():
    spec = ReweightingSpec("stickbreaking")
    assert spec.build().causal_only  # causal unless the layer says otherwise
    with pytest.raises(
        ValueError,
        match=r"^reweighting 'stickbreaking' attends only to earlier keys and needs causal attention; "
        r"the attention is not causal \(use it in decoder self-attention only\)$",
    ):
        spec.build(causal=False)
    with pytest.raises(ValueError, match=r"the cross-attention is not causal"):
        spec.build(causal=False, site="cross-attention")
