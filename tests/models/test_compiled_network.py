"""The networks compile whole, with no graph break, for every registered reweighting function.

For each (model, function) pair the training loss (attention and the output layer) is traced by
``torch.compile(..., fullgraph=True)``: any graph break fails the test with Dynamo's message, which
names the function and the line. On the ViT and the encoder-decoder Dynamo runs alone; for every
function on the LM, and for the functions with Triton kernels on all three models (the transformers
with one layer), the ``aot_eager`` backend also traces the backward graph (AOTAutograd) and runs both
with the eager kernels, without generating code; the Triton kernels run under the interpreter
(``tests/conftest.py`` sets ``TRITON_INTERPRET``).
Inductor, which generates code, runs on two ViT pairs only (slow).

The compiled loss and gradients are compared with the eager model's. Tolerances (fp32): with
``aot_eager`` the same ATen kernels run, but AOTAutograd's backward graph may add a gradient's
contributions (a weight used by several ops) in another order, a few ulps: ``rtol 1e-5``,
``atol 1e-6`` (gradients are O(1e-2..1)). Inductor fuses and reorders the reductions of softmax,
LayerNorm and the matmuls' epilogues: ``rtol 1e-4``, ``atol 1e-5``, still far below the change a
wrong graph makes (a missing term changes the loss in the second digit).

The micro models come from ``tests/helpers/models.py`` (``micro_vit``, ``tiny``).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from mmlight import reweighting
from mmlight.models import ReweightedViT, TransformerLM, TransformerSeq2Seq
from mmlight.reweighting import MultiMax, ReweightingSpec
from mmlight.reweighting.registry import registered
from tests.helpers.models import PAD, micro_vit, tiny

MODELS = ("vit", "lm", "seq2seq")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def buildable(model: str, name: str) -> bool:
    """Whether function ``name`` can serve every attention layer of ``model``: a causal-only function
    (stick-breaking) refuses the ViT's and an encoder's non-causal self-attention."""
    return model == "lm" or not registered(name).causal_only


def pairs(names) -> list:
    return [pytest.param(m, n, id=f"{m}-{n}") for m in MODELS for n in names if buildable(m, n)]


def kernel_names() -> list[str]:
    """The registered functions that have Triton kernels."""
    return [n for n in reweighting.available() if reweighting.build(n).fused() is not None]


def build(
    model: str, name: str, backend: str, gate: str = "none", layers: int = 2, batch: int = 3, vit_blocks: int = 4
):
    """A micro model with function ``name`` in every attention layer (and MultiMax on the output for
    ``multimax``), gated attention of kind ``gate``, no dropout, in training mode, with MultiMax moved off
    its near-softmax start, and ``batch`` examples with padding: ``(model, loss_of(model) -> scalar)``. The
    transformers have ``layers`` decoder layers (and as many encoder layers for ``seq2seq``); the ViT
    is ``micro_vit``'s first ``vit_blocks`` blocks (it has 4)."""
    spec, output = ReweightingSpec(name), name == "multimax"
    g = torch.Generator().manual_seed(0)
    if model == "vit":
        config = micro_vit(attention=spec, output_multimax=output, backend=backend, drop_path_rate=0.0, gate=gate)
        net = ReweightedViT(config)
        net.vit.blocks = net.vit.blocks[:vit_blocks]  # timm's blocks are an nn.Sequential
        images, labels = torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)
        inputs = (images, labels)
    else:
        encoder = layers if model == "seq2seq" else 0
        config = tiny(
            encoder, name=name, output_multimax=output, backend=backend, dropout=0.0, gate=gate, n_layers=layers
        )
        net = TransformerSeq2Seq(config) if model == "seq2seq" else TransformerLM(config)
        tokens = torch.randint(2, 23, (batch, 7), generator=g)
        tokens[0, 5:] = PAD  # padding: masks reach attention and the loss
        targets = torch.randint(2, 23, (batch, 7), generator=g)
        targets[0, 5:] = PAD
        if model == "seq2seq":
            src = torch.randint(2, 23, (batch, 6), generator=g)
            src[1, 4:] = PAD
            inputs = (src, tokens, targets)
        else:
            inputs = (tokens, targets)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, MultiMax):
                m.ts.uniform_(-0.5, 0.5, generator=g)
                m.ranges.uniform_(-1.0, 1.0, generator=g)
    net.train()

    def loss_of(loss_fn):
        out = loss_fn(*inputs)
        return out if model == "vit" else out[0] / out[1]  # (summed NLL, count) for the transformers

    return net, loss_of


def compare_compiled(model, name, backend, compile_backend, rtol, atol, gate="none", layers=2, batch=3, vit_blocks=4):
    net, loss_of = build(model, name, backend, gate, layers, batch, vit_blocks)
    compiled = torch.compile(net.loss, backend=compile_backend, fullgraph=True)
    got = loss_of(compiled)
    got.backward()
    got_grads = {k: p.grad.clone() for k, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    want = loss_of(net.loss)
    want.backward()
    want_grads = {k: p.grad for k, p in net.named_parameters() if p.grad is not None}
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert got_grads.keys() == want_grads.keys()
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")
    if name == "multimax":  # the sigma parameters receive gradients through the compiled graph
        assert any(".reweight." in k or "attn.reweight" in k or "output." in k for k in got_grads)


@pytest.mark.parametrize("model, name", [p for p in pairs(reweighting.available()) if p.values[0] != "lm"])
def test_no_graph_break_in_any_network_with_any_function(model, name):
    """Dynamo alone (the ``eager`` backend: no AOTAutograd, no code generation) with ``fullgraph``: a
    graph break anywhere in the forward pass raises, naming it; the backward runs eagerly. The LM's
    pairs are :func:`test_compiled_lm_matches_eager_for_every_function`'s: the same model and batch
    traced by the same Dynamo with ``fullgraph``, before AOTAutograd."""
    net, loss_of = build(model, name, "auto")
    loss = loss_of(torch.compile(net.loss, backend="eager", fullgraph=True))
    loss.backward()
    assert torch.isfinite(loss)


# each network, and each gate on the LM (the quickest to compile): the gate is one module (nn/gate.py)
# whichever network holds it; the ViT sets it on timm's attention, and the LM and the encoder-decoder share
# one attention class, whose cross-attention the encoder-decoder adds
GATED = [("vit", "headwise"), ("lm", "headwise"), ("lm", "elementwise"), ("seq2seq", "elementwise")]


@pytest.mark.parametrize("model, gate", GATED)
def test_gated_attention_compiles_whole_and_matches_eager(model, gate):
    """The output gate (Qiu et al. 2025) in every attention layer, with MultiMax (the function with the
    most parameters to differentiate): no graph break, and ``aot_eager``'s loss and gradients, the gate's
    included, equal eager's within the tolerances above."""
    compare_compiled(model, "multimax", "auto", "aot_eager", rtol=1e-5, atol=1e-6, gate=gate)


@pytest.mark.parametrize("name", reweighting.available())
def test_compiled_lm_matches_eager_for_every_function(name):
    """AOTAutograd traces the forward and backward graphs of the LM (attention and, for MultiMax, the
    output layer) and runs them with the eager kernels."""
    compare_compiled("lm", name, "auto", "aot_eager", rtol=1e-5, atol=1e-6)


def triton_pairs() -> list:
    """The pairs with a Triton kernel; under the interpreter the ViT's and the encoder-decoder's take
    minutes, so they are marked slow (they still run in CI) and the LM's stay in the fast tests."""
    return [
        pytest.param(*p.values, id=p.id, marks=() if p.values[0] == "lm" else pytest.mark.slow)
        for p in pairs(kernel_names())
    ]


@pytest.mark.parametrize("model, name", triton_pairs())
def test_compiles_whole_with_the_triton_kernels_as_operators(model, name):
    """The interpreter's time grows with the kernels' programs (a batch row and head each, per layer), so
    the batch has 2 examples here (still a batch stride, and padding) and the transformers one layer: the
    encoder-decoder's graph still calls the attention operator three times (encoder, causal decoder and
    cross-attention) and the ViT's four times; the 2-layer graphs are traced above."""
    compare_compiled(model, name, "triton", "aot_eager", rtol=1e-5, atol=1e-6, layers=1, batch=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["softmax", "multimax"])
def test_inductor_matches_eager_on_the_vit(name):
    """Inductor's generated code for one block (its compile time grows with the blocks; the 4-block graph
    is traced by the ``aot_eager`` tests above): loss and every gradient equal eager's."""
    compare_compiled("vit", name, "auto", "inductor", rtol=1e-4, atol=1e-5, vit_blocks=1)


#: The kernel switches (docs/kernels.md), all away from their shipped settings at once (the other
#: compiled tests run the shipped ones): the operators' fake functions, autograd registrations and
#: the cross-entropy's operators of either gradient pass carry them through the compiled graph.
KERNEL_SWITCHES = (
    ("mmlight.kernels.attention", "PARAM_SUMS_PER_PROGRAM"),
    ("mmlight.kernels.attention", "OUTPUT_IN_CALLER_LAYOUT"),
    ("mmlight.kernels.attention", "SINGLE_PASS_BACKWARD"),
    ("mmlight.kernels.attention", "MASK_FREE_INTERIOR"),
    ("mmlight.kernels.rowwise", "PERSISTENT_ROWS"),
    ("mmlight.kernels.cross_entropy", "GRADIENT_IN_BACKWARD"),
)


def test_compiles_whole_with_every_kernel_switch_flipped(monkeypatch):
    for module, switch in KERNEL_SWITCHES:
        monkeypatch.setattr(f"{module}.{switch}", not getattr(importlib.import_module(module), switch))
    compare_compiled("lm", "multimax", "triton", "aot_eager", rtol=1e-5, atol=1e-6, layers=1, batch=2)
