"""MultiMax as a FlexAttention ``score_mod`` (the benchmark's peer) against the package's reference
attention, on the CPU: uncompiled FlexAttention, forward only (its eager backward needs a GPU)."""

import importlib
import re

import pytest
import torch

from benchmarks.flex_multimax import (
    causal_block_mask,
    flex_multimax_attention,
    multimax_score_mod,
    require_learnable_captures,
)
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


@pytest.mark.parametrize(
    "version, refused",
    [("2.9.1", True), ("2.13.1+cu128", True), ("2.14.0a0+145a3a7bda.nv26.08", False), ("2.15.0", False)],
)
def test_learnable_captures_need_torch_2_14(monkeypatch, version, refused):
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    if refused:
        with pytest.raises(RuntimeError, match=rf"needs torch >= 2\.14; this is torch {re.escape(version)}\."):
            require_learnable_captures()
    else:
        require_learnable_captures()


def test_flex_refuses_learnable_parameters_before_torch_2_14_and_runs_without_grad(monkeypatch):
    """The check sits where the parameters would be trained: with grad, before any work; under no_grad the
    same call runs (the benchmark's and the tests' forward on older torch)."""
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.9.1"))
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 8, 16, generator=gen).unbind(0)
    ranges = torch.tensor(RANGES[1], requires_grad=True)
    ts = torch.tensor(TS[1], requires_grad=True)
    with pytest.raises(RuntimeError, match="learnable captured parameters"):
        flex_multimax_attention(q, k, v, ranges, ts)
    with torch.no_grad():
        got = flex_multimax_attention(q, k, v, ranges, ts)
        want = attention_module.attention(q, k, v, multimax(1), backend="reference")
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("order, causal", [(1, False), (2, True)])
def test_frozen_forward_matches_reference(monkeypatch, order, causal):
    """Sigma's parameters captured as Python floats (the benchmark's peer, for a torch whose FlexAttention
    cannot differentiate captured tensors): the forward equals the reference attention, with the
    parameters requiring grad and grad mode on, and no torch version check stands in the way (the CPU's
    eager FlexAttention has no backward, so the gradients of q, k, v are the GPU run's)."""
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.9.1"))
    gen = torch.Generator().manual_seed(10 + order)
    q, k, v = torch.randn(3, 2, 3, 20, 16, generator=gen).unbind(0)
    module = multimax(order)
    assert module.ranges.requires_grad and torch.is_grad_enabled()
    block_mask = causal_block_mask(20, 20, "cpu") if causal else None
    got = flex_multimax_attention(q, k, v, module.ranges, module.ts, block_mask=block_mask, frozen=True)
    with torch.no_grad():
        want = attention_module.attention(q, k, v, module, is_causal=causal, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    score = torch.linspace(-3, 3, 13)
    frozen = multimax_score_mod(module.ranges, module.ts, frozen=True)(score, 0, 0, 0, 0)
    torch.testing.assert_close(frozen, module.modulate(score).detach())
    assert not frozen.requires_grad  # plain floats: nothing captured that autograd could reach
