"""Gated attention (Qiu et al. 2025) in every model: each gated attention layer (ViT self-attention,
the LM's and the encoder-decoder's self- and cross-attention) against a float64 transcription of the
paper's equation, with every reweighting function, through the KV cache and beam search."""

import math

import numpy as np
import pytest
import torch

from mmlight import reweighting
from mmlight.models import ReweightedViT, TransformerConfig, TransformerLM, TransformerSeq2Seq, ViTConfig
from mmlight.models.beam_search import BeamSearchConfig, beam_search
from mmlight.reweighting import ReweightingSpec

PAD, EOS = 1, 2
GATES = ["headwise", "elementwise"]


def sigmoid(z):
    return 1 / (1 + np.exp(-z))


def paper_layer(w, x, memory, keep, causal, nh, q="q_proj", kv=("k_proj", "v_proj"), out="out_proj", gate="gate"):
    """One gated attention layer in float64 NumPy, from its weights ``w`` (name -> array):
    ``Y_h = softmax(Q_h K_h^T / sqrt(hs) + mask) V_h``, ``Y'_h = Y_h * sigmoid(X W_g + b_g)_h`` (the gate
    from the queries' input X, one value per head or per channel), heads concatenated, projected.
    Queries with no key get ``Y_h = 0``.

    Args:
        x: queries' input ``(B, T, d)``; memory: keys' input ``(B, S, d)`` (x for self-attention).
        keep: ``(B, S)`` bool key mask or None; causal: mask later keys.
    """
    B, T, d = x.shape
    hs = d // nh

    def heads(z):
        return z.reshape(z.shape[0], z.shape[1], nh, -1).transpose(0, 2, 1, 3)  # (B, nh, T, width)

    def linear(name, z):
        return z @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    qh, kh, vh = heads(linear(q, x)), heads(linear(kv[0], memory)), heads(linear(kv[1], memory))
    scores = qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(hs)  # (B, nh, T, S)
    allowed = np.ones(scores.shape, dtype=bool)
    if keep is not None:
        allowed &= keep[:, None, None, :]
    if causal:
        allowed &= np.tril(np.ones((T, memory.shape[1]), dtype=bool))
    e = np.where(
        allowed,
        np.exp(
            np.where(allowed, scores, -np.inf)
            - np.where(allowed, scores, -np.inf).max(-1, keepdims=True, initial=-1e300)
        ),
        0.0,
    )
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    y = (p @ vh) * heads(sigmoid(linear(gate, x)))  # (B, nh, T, hs) * (B, nh, T, 1|hs)
    return linear(out, y.transpose(0, 2, 1, 3).reshape(B, T, d))


def weights_of(module):
    return {name: p.detach().double().numpy() for name, p in module.named_parameters()}


def randomised(model):
    """``model`` in float64, eval mode, with every bias moved off its zero init (so each takes part)."""
    torch.manual_seed(1)
    model = model.double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.5)
    return model


def calls_of(layer, run):
    """``run()`` with a hook on ``layer``: its (args, kwargs, output) per call."""
    seen = []
    handle = layer.register_forward_hook(lambda m, a, kw, out: seen.append((a, kw, out)), with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen


def tiny_config(n_encoder_layers, gate, name="softmax", **fields):
    base = dict(vocab_size=19, d_model=16, n_heads=2, ffn_dim=24, n_layers=2, max_positions=32, pad_id=PAD)
    base.update(dropout=0.0, pre_norm=True, attention=ReweightingSpec(name), gate=gate)
    return TransformerConfig(n_encoder_layers=n_encoder_layers, **{**base, **fields})


def padded_tokens(B, T, seed):
    tokens = torch.randint(3, 19, (B, T), generator=torch.Generator().manual_seed(seed))
    tokens[0, T - 2 :] = PAD
    return tokens


@pytest.mark.parametrize("gate", GATES)
def test_lm_self_attention_is_the_papers_equation(gate):
    model = randomised(TransformerLM(tiny_config(0, gate)))
    layer = model.decoder.layers[1].self_attn
    x = padded_tokens(3, 6, seed=0)
    ((args, kwargs, out),) = calls_of(layer, lambda: model(x))
    h = args[0].detach().numpy()  # the layer's input: the pre-norm hidden states
    keep = (x != PAD).numpy()
    want = paper_layer(weights_of(layer), h, h, keep, causal=True, nh=2)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("gate", GATES)
def test_encoder_decoder_self_and_cross_attention_are_the_papers_equation(gate):
    model = randomised(TransformerSeq2Seq(tiny_config(1, gate)))
    src, tgt = padded_tokens(3, 5, seed=1), padded_tokens(3, 4, seed=2)
    src[1] = PAD  # a fully padded source: cross-attention has no key, only the gate's bias path is left
    layers = {
        "encoder": model.encoder.layers[0].self_attn,
        "decoder": model.decoder.layers[0].self_attn,
        "cross": model.decoder.layers[0].cross_attn,
    }
    seen = {}
    hooks = [  # a hook that returns None, so the layer's output stays as it is
        layer.register_forward_hook(lambda m, a, kw, out, n=n: seen.__setitem__(n, (a, kw, out)), with_kwargs=True)
        for n, layer in layers.items()
    ]
    model(src, tgt)
    for handle in hooks:
        handle.remove()
    src_keep, tgt_keep = (src != PAD).numpy(), (tgt != PAD).numpy()
    for name, (layer, causal, keep) in {
        "encoder": (layers["encoder"], False, src_keep),
        "decoder": (layers["decoder"], True, tgt_keep),
        "cross": (layers["cross"], False, src_keep),
    }.items():
        args, kwargs, out = seen[name]
        x = args[0].detach().numpy()
        memory = args[1].detach().numpy() if name == "cross" else x
        want = paper_layer(weights_of(layer), x, memory, keep, causal=causal, nh=2)
        np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("gate", GATES)
def test_vit_self_attention_is_the_papers_equation(gate):
    config = ViTConfig(variant="vit_micro", img_size=8, patch_size=2, in_chans=1, num_classes=10, gate=gate)
    model = randomised(ReweightedViT(config))
    layer = model.vit.blocks[2].attn
    ((args, kwargs, out),) = calls_of(layer, lambda: model(torch.randn(2, 1, 8, 8, dtype=torch.float64)))
    x = args[0].detach().numpy()  # norm1 of the block's input
    w = weights_of(layer)
    d = x.shape[-1]
    for i, part in enumerate(("q", "k", "v")):  # timm's fused qkv, split as the transcription names them
        w[f"{part}.weight"], w[f"{part}.bias"] = (
            w["qkv.weight"][i * d : (i + 1) * d],
            w["qkv.bias"][i * d : (i + 1) * d],
        )
    want = paper_layer(w, x, x, None, causal=False, nh=4, q="q", kv=("k", "v"), out="proj", gate="out_gate")
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("gate", GATES)
def test_each_vit_attention_site_carries_its_blocks_gate(gate):
    """The statistics callback and the analysis read a site's gate values through ``AttentionSite.gate``."""
    config = ViTConfig(variant="vit_micro", img_size=8, patch_size=2, in_chans=1, num_classes=10, gate=gate)
    model = ReweightedViT(config)
    sites = model.attention_sites()
    assert list(sites) == [f"blocks.{i}" for i in range(len(model.vit.blocks))]
    for i, block in enumerate(model.vit.blocks):
        assert block.attn.out_gate is not None and sites[f"blocks.{i}"].gate is block.attn.out_gate
    plain = ReweightedViT(ViTConfig(variant="vit_micro", img_size=8, patch_size=2, in_chans=1, num_classes=10))
    assert all(site.gate is None for site in plain.attention_sites().values())


def test_no_gate_keeps_every_parameter_and_checkpoint_as_it_was():
    """``gate: none`` (the default) adds no parameter: the state dicts of the three models are those of
    plain attention, and a gated model holds one gate per attention layer."""
    for build in (lambda g: TransformerLM(tiny_config(0, g)), lambda g: TransformerSeq2Seq(tiny_config(1, g))):
        plain, gated = build("none").state_dict(), build("elementwise").state_dict()
        assert not any(".gate." in k for k in plain)
        assert {k for k in gated if ".gate." not in k} == set(plain)
        assert len([k for k in gated if k.endswith(".gate.weight")]) == len(build("none").attention_sites())
    vit = ReweightedViT(ViTConfig(variant="vit_micro", img_size=8, patch_size=2, in_chans=1, num_classes=10))
    assert not any("gate." in k for k in vit.state_dict()) and TransformerConfig(vocab_size=5).gate == "none"


def test_transformer_gate_is_initialised_as_the_query_projection():
    """The paper's released code computes the gate as extra rows of ``q_proj``: the same initial
    distribution as the query weights (fairseq's Xavier-uniform range for q_proj here), zero bias."""
    torch.manual_seed(0)
    layer = TransformerLM(tiny_config(0, "elementwise", d_model=256, n_heads=4)).decoder.layers[0].self_attn
    bound = 2**-0.5 * math.sqrt(6 / (256 + 256))
    for w in (layer.q_proj.weight, layer.gate.weight):
        assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound
        assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.02)  # a uniform's std
    assert (layer.gate.bias == 0).all()
    headwise = TransformerLM(tiny_config(0, "headwise", d_model=256, n_heads=4)).decoder.layers[0].self_attn.gate
    assert headwise.weight.shape == (4, 256) and headwise.weight.abs().max() <= bound


NON_CAUSAL = [name for name in reweighting.available() if not reweighting.build(name).causal_only]


@pytest.mark.parametrize("name", reweighting.available())
def test_every_reweighting_trains_and_decodes_incrementally_with_a_gate(name):
    """With each function: finite loss and gradients on a padded batch (the gate's weights get one),
    and decoding token by token through the KV cache gives the full forward pass's states."""
    models = [TransformerLM(tiny_config(0, "elementwise", name))]
    if name in NON_CAUSAL:
        models.append(TransformerSeq2Seq(tiny_config(1, "headwise", name)))
    for model in models:
        src, tgt = padded_tokens(3, 5, seed=3), padded_tokens(3, 6, seed=4)
        inputs = (tgt,) if isinstance(model, TransformerLM) else (src, tgt)
        total, n = model.loss(*inputs, tgt)
        total.backward()
        gates = [p.grad for k, p in model.named_parameters() if ".gate." in k]
        assert torch.isfinite(total) and gates and all(g is not None and torch.isfinite(g).all() for g in gates)
        assert any(g.abs().sum() > 0 for g in gates)
        model.eval()
        with torch.no_grad():
            if isinstance(model, TransformerLM):
                full, cache = model(tgt), model.new_cache()
                steps = [model(tgt[:, t : t + 1], cache=cache) for t in range(6)]
            else:
                memory, cache = model.encode(src), model.new_cache()
                full = model.decode(tgt, memory, model.source_mask(src))
                steps = [model.decode(tgt[:, t : t + 1], memory, model.source_mask(src), cache) for t in range(6)]
        torch.testing.assert_close(torch.cat(steps, 1)[tgt != PAD], full[tgt != PAD], rtol=1e-5, atol=1e-5)


def test_beam_search_through_the_cache_scores_its_hypotheses_as_the_full_model_does():
    """Beam search (cache appended and reordered every step) with gated attention: each hypothesis's
    score equals its length-normalised log-probability recomputed by full forward passes."""
    torch.manual_seed(5)
    model = randomised(TransformerSeq2Seq(tiny_config(1, "elementwise", share_output_embedding=False)))
    with torch.no_grad():
        model.output_projection.weight.normal_(std=0.6)  # peaked, varied next-token distributions
    src = padded_tokens(3, 5, seed=5)
    config = BeamSearchConfig(beam_size=3, max_len_a=1.0, max_len_b=2, length_penalty=1.0)
    hyps, scores = beam_search(model, src, None, config, start_id=EOS, eos_id=EOS, pad_id=PAD, banned_ids=(0,))
    for b, hyp in enumerate(hyps):
        row = src[b][src[b] != PAD][None]
        decoder_in = torch.tensor([[EOS, *hyp.tolist()]])
        with torch.no_grad():
            lprobs = torch.log_softmax(model.logits(model(row, decoder_in))[0], -1)  # (len + 1, V)
        targets = torch.tensor([*hyp.tolist(), EOS])
        want = lprobs.gather(1, targets[:, None]).sum().item() / len(targets)
        assert scores[b].item() == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("backend", ["compile", "triton"])
def test_gated_multimax_on_each_backend_equals_the_reference(backend):
    """The gate multiplies attention's output whatever computed it: MultiMax's fused Triton attention
    (under the interpreter without a GPU) and the compiled reference give the reference backend's states."""
    torch.manual_seed(6)
    reference = TransformerLM(tiny_config(0, "elementwise", "multimax", backend="reference")).eval()
    other = TransformerLM(tiny_config(0, "elementwise", "multimax", backend=backend)).eval()
    other.load_state_dict(reference.state_dict())
    x = padded_tokens(2, 6, seed=6)
    x[0, 4:] = 5  # no padding: a key-padding-free batch takes the fused kernel
    with torch.no_grad():
        torch.testing.assert_close(other(x), reference(x), rtol=1e-4, atol=1e-4)
