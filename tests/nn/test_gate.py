"""The output gate of gated attention (Qiu et al. 2025): its formula, shapes and initialisation, and the
gated timm layer against a float64 transcription of the paper's equation."""

import numpy as np
import pytest
import torch

from mmlight.nn import ReweightedAttention
from mmlight.nn.gate import OutputGate, output_gate


def sigmoid(z):
    return 1 / (1 + np.exp(-z))


@pytest.mark.parametrize("kind, width", [("headwise", 1), ("elementwise", 4)])
def test_gate_is_the_sigmoid_of_a_linear_map_per_head(kind, width):
    """``sigmoid(x W_g + b_g)`` with its outputs head-major: head h owns outputs ``h*width .. (h+1)*width - 1``."""
    gate = output_gate(kind, dim=6, num_heads=3, head_dim=4).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    got = gate(x).detach().numpy()  # (B, nh, T, width)
    flat = sigmoid(x.numpy() @ gate.weight.detach().numpy().T + gate.bias.detach().numpy())  # (B, T, nh * width)
    assert got.shape == (2, 3, 5, width)
    for h in range(3):
        np.testing.assert_allclose(got[:, h], flat[..., h * width : (h + 1) * width], rtol=1e-14)


def test_none_adds_nothing_and_a_wrong_kind_is_named():
    assert output_gate("none", 6, 3, 4) is None
    with pytest.raises(ValueError, match="'headwise' or 'elementwise', got 'channelwise'"):
        OutputGate(6, 3, 4, "channelwise")


@pytest.mark.parametrize("bias", [None, True, False])
def test_the_gate_has_a_bias_unless_told_otherwise(bias):
    """A bias per output by default (as the paper's ``X W_g + b_g``); ``bias=False`` for bias-free models."""
    kwargs = {} if bias is None else {"bias": bias}
    for gate in (OutputGate(6, 3, 4, "headwise", **kwargs), output_gate("elementwise", 6, 3, 4, **kwargs)):
        outputs = gate.weight.shape[0]
        assert outputs == (3 if gate.kind == "headwise" else 12)
        assert sum(p.numel() for p in gate.parameters()) == 6 * outputs + (outputs if bias is not False else 0)


def paper_timm_layer(layer, x, gate):
    """The gated layer written out in float64 NumPy from its weights: per head ``Y_h = softmax(Q_h K_h^T /
    sqrt(hs)) V_h``, then ``Y'_h = Y_h * sigmoid(X W_g + b_g)_h`` (one value per head or per channel),
    heads concatenated, then the output projection."""
    B, N, C = x.shape
    nh, hs = layer.num_heads, layer.head_dim
    w = {name: p.detach().double().numpy() for name, p in layer.named_parameters()}
    qkv = (x @ w["qkv.weight"].T + w["qkv.bias"]).reshape(B, N, 3, nh, hs)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # (B, nh, N, hs)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hs)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    y = (p / p.sum(-1, keepdims=True)) @ v  # (B, nh, N, hs)
    if gate != "none":
        g = sigmoid(x @ w["out_gate.weight"].T + w["out_gate.bias"]).reshape(B, N, nh, -1).transpose(0, 2, 1, 3)
        y = y * g
    y = y.transpose(0, 2, 1, 3).reshape(B, N, C)
    return y @ w["proj.weight"].T + w["proj.bias"]


@pytest.mark.parametrize("gate", ["none", "headwise", "elementwise"])
def test_timm_layer_is_the_papers_equation(gate):
    torch.manual_seed(0)
    layer = ReweightedAttention(12, num_heads=3, qkv_bias=True)
    layer.set_gate(gate)
    layer = layer.double().eval()
    with torch.no_grad():  # biases away from their zero init, so that each takes part
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    np.testing.assert_allclose(layer(x).detach().numpy(), paper_timm_layer(layer, x.numpy(), gate), rtol=1e-10)
    assert (layer.out_gate is None) == (gate == "none")


def test_timm_gate_is_initialised_as_the_qkv_projection():
    """timm initialises ``qkv`` with a truncated normal of std 0.02 and zero bias; the gate gets the same,
    as the paper's released code gives its gate rows the query projection's init."""
    torch.manual_seed(0)
    layer = ReweightedAttention(192, num_heads=3, qkv_bias=True)
    layer.set_gate("elementwise")
    w = layer.out_gate.weight.detach()
    assert w.shape == (192, 192) and (layer.out_gate.bias == 0).all()
    assert w.std().item() == pytest.approx(0.02, rel=0.05) and w.mean().abs() < 1e-3
    no_bias = ReweightedAttention(16, num_heads=2, qkv_bias=False)
    no_bias.set_gate("headwise")
    assert no_bias.out_gate.bias is None and no_bias.out_gate.weight.shape == (2, 16)
