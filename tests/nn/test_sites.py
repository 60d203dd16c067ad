"""The typed records of attention sites: a site's key stack, the names that index them, and the
reweighting modules a network reports."""

import pytest
from torch import nn

from mmlight.nn.sites import AttentionSite, Block, reweighting_modules, sites_by_name


def test_keys_come_from_the_own_stack_unless_another_is_named():
    module = nn.Identity()
    self_attn = AttentionSite("encoder.layers.0.self_attn", "encoder_self", "encoder", 0, module)
    cross = AttentionSite("decoder.layers.1.cross_attn", "cross", "decoder", 1, module, key_stack="encoder")
    assert self_attn.key_stack is None and self_attn.keys_from == "encoder"
    assert cross.keys_from == "encoder" and cross.stack == "decoder"
    assert Block("blocks.0", "blocks", 0, module).prefix == 0


def test_sites_are_indexed_by_name_in_order_and_names_must_not_repeat():
    modules = [nn.Identity() for _ in range(3)]
    sites = [AttentionSite(name, "self", "blocks", i, m) for i, (name, m) in enumerate(zip("cab", modules))]
    named = sites_by_name(sites)
    assert list(named) == ["c", "a", "b"] and all(named[s.name] is s for s in sites)
    assert sites_by_name([]) == {}
    twice = [*sites, AttentionSite("a", "self", "blocks", 3, modules[0])]
    with pytest.raises(ValueError, match=r"attention site names repeat: \['c', 'a', 'b', 'a'\]"):
        sites_by_name(twice)


def test_reweighting_modules_are_the_sites_modules_and_the_output():
    first, second, output = nn.Identity(), nn.Identity(), nn.Identity()
    sites = {"x": AttentionSite("x", "self", "blocks", 0, first), "y": AttentionSite("y", "self", "blocks", 1, second)}
    without = reweighting_modules(sites, None)
    assert list(without) == ["x", "y"] and without["x"] is first and without["y"] is second
    with_output = reweighting_modules(sites, output)
    assert list(with_output) == ["x", "y", "output"] and with_output["output"] is output
    assert reweighting_modules({}, None) == {}
