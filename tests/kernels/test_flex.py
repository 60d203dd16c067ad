"""MultiMax as a FlexAttention ``score_mod`` (the benchmark's peer) against the package's reference
attention, on the CPU: uncompiled FlexAttention, forward only (its eager backward needs a GPU)."""

import importlib

import pytest
import torch

from benchmarks.flex_multimax import causal_block_mask, flex_multimax_attention, multimax_score_mod
from mmlight.reweighting import MultiMax

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
attention_module = importlib.import_module("mmlight.nn.attention")  # the package re-exports the function

RANGES = {1: [-0.5, 0.6], 2: [-0.5, 0.6, -1.0, 1.2]}
TS = {1: [0.3, 0.25], 2: [0.3, 0.25, 0.1, 0.05]}


def multimax(order):
    module = MultiMax(order=order, backend="reference")
    with torch.no_grad():
        module.ranges.copy_(torch.tensor(RANGES[order]))
        module.ts.copy_(torch.tensor(TS[order]))
    return module


@pytest.mark.parametrize("order, causal, q_len", [(1, False, 20), (2, True, 20), (2, True, 12)])
def test_forward_matches_reference(order, causal, q_len):
    gen = torch.Generator().manual_seed(order)
    q = 2 * torch.randn(2, 3, q_len, 16, generator=gen)
    k, v = torch.randn(2, 2, 3, 20, 16, generator=gen).unbind(0)
    module = multimax(order)
    block_mask = causal_block_mask(q_len, 20, "cpu") if causal else None
    with torch.no_grad():
        got = flex_multimax_attention(q, k, v, module.ranges, module.ts, block_mask=block_mask)
        want = attention_module.attention(q, k, v, module, is_causal=causal, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_score_mod_is_sigma_and_keeps_the_parameters_differentiable():
    ranges = torch.tensor(RANGES[2], requires_grad=True)
    ts = torch.tensor(TS[2], requires_grad=True)
    score = torch.linspace(-3, 3, 13)
    got = multimax_score_mod(ranges, ts)(score, 0, 0, 0, 0)
    torch.testing.assert_close(got, multimax(2).modulate(score))
    got.sum().backward()
    assert ranges.grad is not None and ts.grad is not None and ts.grad.abs().sum() > 0


def test_bad_parameter_shapes_raise():
    with pytest.raises(ValueError, match=r"\(2,\) or \(4,\)"):
        multimax_score_mod(torch.zeros(3), torch.zeros(3))
