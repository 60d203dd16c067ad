"""Transformer LM and encoder-decoder: presets, incremental decoding, masking, loss, backends."""

import pytest
import torch
import torch.nn.functional as F

from mmlight import reweighting
from mmlight.models.transformer import (
    DecoderLayer,
    FeedForward,
    KVCache,
    MultiHeadAttention,
    Residual,
    TokenPositionEmbedding,
    TransformerConfig,
    TransformerLM,
    TransformerSeq2Seq,
    none_if_all,
    token_embedding,
)
from mmlight.reweighting import MultiMax, ReweightingSpec, multimax_sigma
from mmlight.reweighting.stickbreaking import StickBreaking
from tests.helpers.models import PAD, tiny, tiny_transformer


def randomize_multimax(model, scale=0.5):
    """Move every MultiMax away from its near-softmax init so that it matters in comparisons."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MultiMax):
                m.ts.uniform_(-scale, scale)
                m.ranges.uniform_(-1.0, 1.0)


def tokens(B, T, low=2, high=23, generator=None):
    return torch.randint(low, high, (B, T), generator=generator)


# ---------------------------------------------------------------------------------------------
# Presets


def expected_params(c: TransformerConfig, mm_per_layer: int = 0) -> int:
    """Parameter count from the architecture, written out independently of the modules."""
    d, f, V = c.d_model, c.ffn_dim, c.vocab_size
    attn = 4 * (d * d + d) + mm_per_layer  # q, k, v, out projections with bias (+ MultiMax)
    ffn = d * f + f + f * d + d
    ln = 2 * d
    emb = V * d
    n = emb + (0 if c.share_output_embedding else V * d)
    if c.n_encoder_layers:
        n += 0 if c.share_embeddings else (c.src_vocab_size or V) * d
        n += c.n_encoder_layers * (attn + ffn + 2 * ln) + c.n_layers * (2 * attn + ffn + 3 * ln)
        n += 2 * ln if c.pre_norm else 0
    else:
        n += c.n_layers * (attn + ffn + 2 * ln) + (ln if c.pre_norm else 0)
    if c.positions == "learned":  # a learned table per stack
        n += c.max_positions * d * (2 if c.n_encoder_layers else 1)
    if c.output_multimax:
        n += 2 * c.output_multimax_order * 2
    return n


def count(model):
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def test_preset_parameter_counts():
    lm = TransformerConfig.transformer_lm_wikitext103(267_744)
    assert (lm.n_layers, lm.d_model, lm.ffn_dim, lm.n_heads, lm.share_output_embedding) == (6, 512, 2048, 8, True)
    assert expected_params(lm) == 155_999_232  # the paper's ~156M (tolerance: 0.1M)
    with torch.device("meta"):
        assert count(TransformerLM(lm)) == expected_params(lm)
    mt = TransformerConfig.transformer_iwslt_de_en(10_000)
    arch = (mt.n_encoder_layers, mt.n_layers, mt.d_model, mt.ffn_dim, mt.n_heads, mt.dropout, mt.share_embeddings)
    assert arch == (6, 6, 512, 1024, 4, 0.3, True)
    assert expected_params(mt) / 1e6 == pytest.approx(36.7, abs=0.05)
    with torch.device("meta"):
        assert count(TransformerSeq2Seq(mt)) == expected_params(mt)
        # MultiMax adds 8 parameters (order 2: 4 ranges, 4 ts) per attention layer: 6 encoder + 2 * 6 decoder.
        mm = TransformerConfig.transformer_iwslt_de_en(10_000, attention=ReweightingSpec("multimax"))
        assert count(TransformerSeq2Seq(mm)) == expected_params(mt) + 8 * 18


def test_presets_set_every_field_of_their_recipe():
    """Every field the two presets set (their docstrings' fairseq recipes), and overrides replacing fields."""
    lm = TransformerConfig.transformer_lm_wikitext103()
    assert (lm.vocab_size, lm.d_model, lm.n_heads, lm.ffn_dim, lm.n_layers, lm.n_encoder_layers) == (
        267_744,
        512,
        8,
        2048,
        6,
        0,
    )
    assert (lm.dropout, lm.attention_dropout, lm.activation_dropout, lm.max_positions) == (0.1, 0.0, 0.0, 512)
    assert lm.pre_norm is False and lm.share_output_embedding is True and lm.positions == "sinusoidal"
    mt = TransformerConfig.transformer_iwslt_de_en()
    assert (mt.vocab_size, mt.d_model, mt.n_heads, mt.ffn_dim, mt.n_layers, mt.n_encoder_layers) == (
        10_000,
        512,
        4,
        1024,
        6,
        6,
    )
    assert (mt.dropout, mt.attention_dropout, mt.activation_dropout, mt.max_positions) == (0.3, 0.0, 0.0, 1024)
    assert mt.pre_norm is False and mt.share_embeddings is True and mt.share_output_embedding is True
    spec = ReweightingSpec("multimax", {"order": 1})
    for preset in (TransformerConfig.transformer_lm_wikitext103, TransformerConfig.transformer_iwslt_de_en):
        c = preset(attention=spec, max_positions=64)
        assert (c.attention, c.max_positions, c.d_model) == (spec, 64, 512)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"pre_norm": True, "share_output_embedding": False, "output_multimax": True},
        {"share_embeddings": False, "src_vocab_size": 23, "positions": "learned", "pre_norm": True},
    ],
)
def test_parameter_formula_variants(kwargs):
    c = tiny(n_encoder_layers=2, name="multimax", **kwargs)
    assert count(TransformerSeq2Seq(c)) == expected_params(c, mm_per_layer=8)
    c = tiny(name="multimax", **{k: v for k, v in kwargs.items() if k not in ("share_embeddings", "src_vocab_size")})
    assert count(TransformerLM(c)) == expected_params(c, mm_per_layer=8)


def test_config_validation():
    with pytest.raises(ValueError, match="multiple"):
        tiny(n_heads=3)
    with pytest.raises(
        ValueError,
        match=r"^share_embeddings needs one joint vocabulary \(src_vocab_size == "
        r"vocab_size\)$",
    ):
        tiny(n_encoder_layers=1, share_embeddings=True, src_vocab_size=30)
    with pytest.raises(
        ValueError, match="^TransformerSeq2Seq needs n_encoder_layers > 0; use TransformerLM for an LM$"
    ):
        TransformerSeq2Seq(tiny())
    with pytest.raises(
        ValueError, match="^TransformerLM is decoder-only: set n_encoder_layers=0 or use TransformerSeq2Seq$"
    ):
        TransformerLM(tiny(n_encoder_layers=1))
    with pytest.raises(ValueError, match="max_positions"):
        TransformerLM(tiny())(tokens(1, 33))


# ---------------------------------------------------------------------------------------------
# Incremental decoding


def lm_model(name, pre_norm=False):
    torch.set_default_dtype(torch.float64)
    model = TransformerLM(tiny(name=name, pre_norm=pre_norm, output_multimax=name == "multimax")).eval()
    randomize_multimax(model)
    return model


@pytest.mark.parametrize("name, pre_norm", [("softmax", False), ("multimax", True)])
def test_lm_incremental_equals_full(name, pre_norm):
    model = lm_model(name, pre_norm)
    x = tokens(3, 7)
    x[1, :2] = PAD  # a left-padded row: its padding stays masked through the cache
    full = model(x)  # (B, T, d)
    cache = model.new_cache()
    steps = [model(x[:, :3], cache=cache)] + [model(x[:, t : t + 1], cache=cache) for t in range(3, 7)]
    assert cache.length == 7 and cache.self_attn[0].keep.shape == (3, 7)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(model.logits(steps[-1]), model.logits(full[:, -1:]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["softmax", "multimax"])
def test_lm_reorder_cache_equals_recomputation(name):
    model = lm_model(name)
    x = tokens(3, 6)
    index = torch.tensor([2, 0, 0, 1])  # beams: a permutation with a duplicate
    cache = model.new_cache()
    model(x[:, :4], cache=cache)
    model.reorder_cache(cache, index)
    y = torch.cat([model(x[index, t : t + 1], cache=cache) for t in (4, 5)], dim=1)
    torch.testing.assert_close(y, model(x[index])[:, 4:], rtol=1e-10, atol=1e-10)


def seq2seq_model(name):
    torch.set_default_dtype(torch.float64)
    model = TransformerSeq2Seq(tiny(2, name=name, share_embeddings=True, output_multimax=name == "multimax")).eval()
    randomize_multimax(model)
    return model


@pytest.mark.parametrize("name", ["softmax", "multimax"])
def test_seq2seq_incremental_and_reorder_equal_full(name):
    model = seq2seq_model(name)
    src, tgt = tokens(3, 5), tokens(3, 6)
    src[0, 3:] = PAD
    src_mask = model.source_mask(src)
    memory = model.encode(src, src_mask)  # (B, S, d)
    full = model.decode(tgt, memory, src_mask)  # (B, T, d)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t : t + 1], memory, src_mask, cache=cache) for t in range(4)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, :4], rtol=1e-10, atol=1e-10)
    assert cache.cross_attn[0].k.shape == (3, 2, 5, 16)  # encoder keys computed once

    index = torch.tensor([1, 2, 0, 0])  # reorder with beam duplication
    model.reorder_cache(cache, index)
    steps = [model.decode(tgt[index, t : t + 1], memory[index], src_mask[index], cache=cache) for t in (4, 5)]
    recomputed = model.decode(tgt[index], memory[index], src_mask[index])
    torch.testing.assert_close(torch.cat(steps, dim=1), recomputed[:, 4:], rtol=1e-10, atol=1e-10)


def test_kv_cache_append_merges_masks():
    cache = KVCache()
    k = torch.zeros(2, 1, 3, 4)
    cache.append(k, k, None)
    _, _, keep = cache.append(k[:, :, :1], k[:, :, :1], torch.tensor([[False], [True]]))
    assert keep.tolist() == [[True, True, True, False], [True, True, True, True]] and len(cache) == 4


def test_kv_cache_reorder_selects_rows_of_keys_values_and_mask():
    k = torch.arange(6.0).reshape(3, 1, 2, 1)  # (B, nh, Tk, hs)
    keep = torch.tensor([[True, False], [True, True], [False, True]])
    cache = KVCache(k, -k, keep)
    cache.reorder(torch.tensor([2, 0, 0]))
    assert torch.equal(cache.k, k[[2, 0, 0]]) and torch.equal(cache.v, -k[[2, 0, 0]])
    assert cache.keep.tolist() == [[False, True], [True, False], [True, False]]


def test_kv_cache_fills_in_masks_on_the_keys_device():
    """The all-kept mask made for keys that came without one is bool and lives where the keys are (the
    meta device stands in for a GPU: mixing it with a CPU tensor is an error, as CUDA's would be)."""
    k = torch.zeros(2, 1, 3, 4, device="meta")
    masks = torch.ones(2, 3, dtype=torch.bool, device="meta"), torch.ones(2, 1, dtype=torch.bool, device="meta")
    for first, second in ((None, masks[1]), (masks[0], None)):
        cache = KVCache()
        cache.append(k, k, first)
        _, _, keep = cache.append(k[:, :, :1], k[:, :, :1], second)
        assert (keep.device.type, keep.dtype, keep.shape) == ("meta", torch.bool, (2, 4))


def test_only_the_encoder_decoder_has_cross_attention_caches_and_sites():
    lm = TransformerLM(tiny())
    assert lm.new_cache().cross_attn == [] and len(lm.new_cache().self_attn) == 2
    assert list(lm.reweighting_sites()) == ["decoder.layers.0.self_attn", "decoder.layers.1.self_attn"]
    assert len(TransformerSeq2Seq(tiny(1)).new_cache().cross_attn) == 2
    for model in (
        TransformerLM(tiny(output_multimax=True, output_multimax_order=1)),
        TransformerSeq2Seq(tiny(1, output_multimax=True, output_multimax_order=1)),
    ):
        assert model.output.order == 1 and model.reweighting_sites()["output"] is model.output


def test_a_mask_that_keeps_everything_becomes_none():
    """None lets attention take its unmasked fast path; any masked key keeps the mask itself."""
    assert none_if_all(None) is None and none_if_all(torch.ones(2, 3, dtype=torch.bool)) is None
    partial = torch.tensor([[True, False, True]])
    assert none_if_all(partial) is partial
    # on the meta device (the FLOP count) no value can be read: the mask is kept, whatever it would hold
    meta = torch.ones(2, 3, dtype=torch.bool, device="meta")
    assert none_if_all(meta) is meta


# ---------------------------------------------------------------------------------------------
# Dropouts, devices and dtypes


def test_every_dropout_reaches_its_layers():
    model = TransformerSeq2Seq(tiny(1, dropout=0.1, attention_dropout=0.2, activation_dropout=0.3))
    attention = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    ffns = [m for m in model.modules() if isinstance(m, FeedForward)]
    residuals = [m for m in model.modules() if isinstance(m, Residual)]
    assert len(attention) == 1 + 2 * 2 and all(m.dropout == 0.2 for m in attention)
    assert len(ffns) == 1 + 2 and all(m.activation_dropout.p == 0.3 for m in ffns)
    assert len(residuals) == 2 + 2 * 3 and all(m.dropout.p == 0.1 for m in residuals)
    assert model.encoder.embed.dropout.p == model.decoder.embed.dropout.p == 0.1
    ffn = FeedForward(8, 12)  # no activation dropout by default
    x = torch.randn(3, 8)
    torch.testing.assert_close(ffn.train()(x), ffn.eval()(x))


def test_attention_dropout_acts_in_training_only():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    plain = MultiHeadAttention(8, 2, ReweightingSpec("softmax").build("reference"))  # no dropout by default
    dropped = MultiHeadAttention(8, 2, ReweightingSpec("softmax").build("reference"), dropout=0.5)
    dropped.load_state_dict(plain.state_dict())
    want = plain.eval()(x)
    torch.testing.assert_close(plain.train()(x), want)
    torch.testing.assert_close(dropped.eval()(x), want)
    assert not torch.allclose(dropped.train()(x), want)


def test_positions_follow_the_tokens_device_and_the_embedding_dtype():
    """The sinusoid table moves to the tokens' device (the meta device stands in for a GPU) and is cast
    to the embedding's dtype (a bf16 model gives bf16 states)."""
    ids = tokens(2, 3)
    embed = TokenPositionEmbedding(token_embedding(23, 32, PAD), tiny())
    assert embed.to(torch.bfloat16)(ids).dtype == torch.bfloat16
    embed = TokenPositionEmbedding(token_embedding(23, 32, PAD), tiny()).to("meta")
    assert embed(ids.to("meta")).device.type == "meta"


# ---------------------------------------------------------------------------------------------
# Masking: finite outputs and gradients with every reweighting


@pytest.mark.parametrize("name", reweighting.available())
def test_padded_batches_finite_with_every_reweighting(name):
    config = tiny(
        1, name=name, n_layers=1, dropout=0.1, attention_dropout=0.1, output_multimax=True, share_embeddings=True
    )
    if reweighting.build(name).causal_only:  # stick-breaking: refused in the encoder and cross-attention
        with pytest.raises(ValueError, match="encoder self-attention is not causal"):
            TransformerSeq2Seq(config)
    else:
        s2s = TransformerSeq2Seq(config).train()
        src, tgt = tokens(3, 5), tokens(3, 4)
        src[1] = PAD  # a fully padded source: cross-attention has no key for that row
        src[2, 2:] = PAD
        tgt[0, 2:] = PAD
        total, n = s2s.loss(src, tgt, tgt)
        assert torch.isfinite(s2s(src, tgt)).all() and torch.isfinite(total) and n == 10
        total.backward()
        assert all(torch.isfinite(p.grad).all() for p in s2s.parameters() if p.grad is not None)

    lm = TransformerLM(tiny(name=name, n_layers=1, pre_norm=True)).train()
    x = tokens(3, 6)
    x[0] = PAD  # every key masked for every query of this row
    x[1, :3] = PAD
    total, n = lm.loss(x, x)
    assert torch.isfinite(lm(x)).all() and torch.isfinite(total) and n == 9  # 18 - 9 pad targets
    total.backward()
    assert all(torch.isfinite(p.grad).all() for p in lm.parameters() if p.grad is not None)


#: The functions a translation model takes in every layer (stick-breaking is causal only).
NON_CAUSAL = [name for name in reweighting.available() if not reweighting.build(name).causal_only]


@pytest.mark.parametrize("name", NON_CAUSAL)
def test_fully_padded_source_gets_zero_cross_attention(name):
    model = TransformerSeq2Seq(tiny(1, name=name)).eval()
    src = tokens(2, 4)
    src[0] = PAD
    outputs = []
    hook = model.decoder.layers[0].cross_attn.register_forward_hook(lambda m, i, o: outputs.append(o))
    model(src, tokens(2, 3))
    hook.remove()
    bias = model.decoder.layers[0].cross_attn.out_proj.bias
    torch.testing.assert_close(outputs[0][0], bias.expand(3, -1))  # zero weights: only the out bias


# ---------------------------------------------------------------------------------------------
# Loss


@pytest.mark.parametrize("output_multimax", [False, True])
def test_loss_matches_cross_entropy(output_multimax):
    model = TransformerLM(tiny(output_multimax=output_multimax)).eval()
    randomize_multimax(model)
    x, y = tokens(2, 5), tokens(2, 5)
    y[0, 4] = PAD  # ignored by default (ignore_index = pad_id)
    loss_mask = torch.ones(2, 5, dtype=torch.bool)
    loss_mask[1, 0] = False
    total, n = model.loss(x, y, loss_mask=loss_mask, label_smoothing=0.1)
    logits = model.logits(model(x)).reshape(10, -1)  # (N, V)
    if output_multimax:
        raw = model.output_projection(model(x)).reshape(10, -1)
        torch.testing.assert_close(logits, multimax_sigma(raw, model.output.ranges, model.output.ts))
    target = torch.where(loss_mask & (y != PAD), y, -100).reshape(-1)
    ref = F.cross_entropy(logits, target, label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(total, ref)
    assert n == 8
    total, n = model.loss(x, y, ignore_index=-100)  # pad targets counted now
    torch.testing.assert_close(total, F.cross_entropy(logits, y.reshape(-1), reduction="sum"))
    assert n == 10
    total, n = model.summed_loss(model(x), y)  # the tasks' NLL: no smoothing by default
    torch.testing.assert_close(total, F.cross_entropy(logits, y.reshape(-1), ignore_index=PAD, reduction="sum"))
    assert n == 9


def test_seq2seq_loss_matches_cross_entropy():
    model = TransformerSeq2Seq(tiny(1, output_multimax=True)).eval()
    randomize_multimax(model)
    src, tgt_in, tgt = tokens(2, 4), tokens(2, 3), tokens(2, 3)
    tgt[1, 2] = PAD
    total, n = model.loss(src, tgt_in, tgt)
    logits = model.logits(model(src, tgt_in)).reshape(6, -1)
    torch.testing.assert_close(total, F.cross_entropy(logits, tgt.reshape(-1), ignore_index=PAD, reduction="sum"))
    assert n == 5
    # every argument reaches the loss: a source mask that also hides a real token, a loss mask,
    # another ignore_index (pad targets count again) and label smoothing
    src_mask = model.source_mask(src)
    src_mask[0, 1] = False
    loss_mask = torch.ones(2, 3, dtype=torch.bool)
    loss_mask[0, 0] = False
    total, n = model.loss(
        src, tgt_in, tgt, src_mask=src_mask, loss_mask=loss_mask, ignore_index=-100, label_smoothing=0.1
    )
    logits = model.logits(model(src, tgt_in, src_mask)).reshape(6, -1)
    want = F.cross_entropy(logits, torch.where(loss_mask, tgt, -100).reshape(-1), label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(total, want)
    assert n == 5


# ---------------------------------------------------------------------------------------------
# Reweighting modules and backends


def test_each_attention_site_carries_its_layers_gate():
    model = TransformerSeq2Seq(tiny(1, gate="headwise"))
    sites = model.attention_sites()
    assert len(sites) == 5  # 1 encoder layer, 2 decoder layers with cross-attention
    assert all(site.gate is model.get_submodule(name).gate is not None for name, site in sites.items())


def test_each_attention_layer_gets_its_own_reweighting_and_backend():
    c = tiny(2, name="multimax", options={"order": 1}, output_multimax=True, backend="compile", share_embeddings=True)
    model = TransformerSeq2Seq(c)
    sites = model.attention_sites()
    assert list(sites) == [
        "encoder.layers.0.self_attn",
        "encoder.layers.1.self_attn",
        "decoder.layers.0.self_attn",
        "decoder.layers.0.cross_attn",
        "decoder.layers.1.self_attn",
        "decoder.layers.1.cross_attn",
    ]
    assert [(s.kind, s.stack, s.layer, s.keys_from) for s in sites.values()] == [
        ("encoder_self", "encoder", 0, "encoder"),
        ("encoder_self", "encoder", 1, "encoder"),
        ("decoder_self", "decoder", 0, "decoder"),
        ("cross", "decoder", 0, "encoder"),
        ("decoder_self", "decoder", 1, "decoder"),
        ("cross", "decoder", 1, "encoder"),
    ]
    assert sites["decoder.layers.1.cross_attn"].module is model.decoder.layers[1].cross_attn.reweight
    assert model.reweighting_sites()["output"] is model.output
    assert [(b.name, b.stack, b.layer, b.prefix) for b in model.blocks()] == [
        (f"{stack}.layers.{i}", stack, i, 0) for stack in ("encoder", "decoder") for i in (0, 1)
    ]
    assert all(b.module is model.encoder.layers[b.layer] for b in model.blocks()[:2])
    lm = TransformerLM(tiny())  # no encoder: the decoder's blocks alone
    assert [(b.name, b.stack, b.layer) for b in lm.blocks()] == [
        ("decoder.layers.0", "decoder", 0),
        ("decoder.layers.1", "decoder", 1),
    ]
    layers = [s.module for s in sites.values()]
    assert len(layers) == 2 + 2 * 2 and len({id(m) for m in layers}) == 6
    assert all(isinstance(m, MultiMax) and m.order == 1 for m in layers)
    modules = [m for m in model.modules() if isinstance(m, reweighting.Reweighting)]
    assert len(modules) == 7 and all(m.backend == "compile" for m in modules)
    assert model.output.order == 2 and model.output_projection.weight is model.decoder.embed.tokens.weight
    assert model.encoder.embed.tokens is model.decoder.embed.tokens  # share_embeddings
    with pytest.raises(ValueError, match="backend"):
        TransformerLM(tiny(name="multimax", options={"backend": "triton"}))


def spy(monkeypatch, module, name):
    """Count calls of ``module.name`` (a kernel entry point imported lazily by its callers)."""
    calls, fn = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


def compare_backends(build, run):
    """Build the model on both backends with the same weights, run ``run(model) -> (output, loss)``,
    backpropagate the loss and compare output, loss and every gradient."""
    models = {b: build(b) for b in ("reference", "triton")}
    randomize_multimax(models["reference"])
    models["triton"].load_state_dict(models["reference"].state_dict())
    results = {}
    for backend, model in models.items():
        out, total = run(model)
        total.backward()
        results[backend] = (out, total, {k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    (ref_out, ref_loss, ref_grads), (tri_out, tri_loss, tri_grads) = results["reference"], results["triton"]
    torch.testing.assert_close(tri_out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tri_loss, ref_loss, rtol=1e-4, atol=1e-4)
    assert tri_grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(tri_grads[name], grad, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("pad", [False, True])
def test_triton_backend_equals_reference_lm(pad, monkeypatch):
    """Fused attention and cross-entropy kernels (Triton's interpreter on the CPU) against eager PyTorch."""
    import mmlight.kernels
    import mmlight.kernels.attention

    attn_calls = spy(monkeypatch, mmlight.kernels.attention, "multimax_attention")
    ce_calls = spy(monkeypatch, mmlight.kernels, "multimax_cross_entropy")
    x = tokens(2, 8)
    if pad:
        x[1, 5:] = PAD

    def build(backend):
        torch.manual_seed(0)
        return TransformerLM(tiny(name="multimax", n_layers=1, dropout=0.0, output_multimax=True, backend=backend))

    def run(model):
        return model(x), model.loss(x, x)[0]

    compare_backends(build, run)
    assert len(attn_calls) == 2 and len(ce_calls) == 1  # triton model only: forward + loss; one CE


def test_triton_backend_equals_reference_seq2seq(monkeypatch):
    """Cross-attention with a key-padding mask (one source fully padded) through the fused kernel."""
    import mmlight.kernels.attention

    attn_calls = spy(monkeypatch, mmlight.kernels.attention, "multimax_attention")
    src, tgt = tokens(2, 6), tokens(2, 4)
    src[0] = PAD
    src[1, 4:] = PAD

    def build(backend):
        torch.manual_seed(0)
        return TransformerSeq2Seq(tiny(1, name="multimax", n_layers=1, dropout=0.0, backend=backend))

    def run(model):
        return model(src, tgt), model.loss(src, tgt, tgt)[0]

    compare_backends(build, run)
    assert len(attn_calls) == 2 * 3  # encoder self, decoder self, cross; forward + loss


def test_triton_incremental_decoding_equals_full():
    """One-query steps against a longer key cache: the fused kernel's bottom-right causal alignment."""
    model = TransformerLM(tiny(name="multimax", n_layers=1, backend="triton")).eval()
    randomize_multimax(model)
    x = tokens(2, 5)
    x[0, 0] = PAD
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache()
        steps = [model(x[:, :2], cache=cache)] + [model(x[:, t : t + 1], cache=cache) for t in range(2, 5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", reweighting.available())
def test_models_hold_no_buffers(name):
    """DDP broadcasts module buffers before every forward, evaluation included; with ranks that run
    different numbers of evaluation batches that collective deadlocks. Constants (sinusoids, a fixed
    temperature) are therefore plain attributes."""
    from mmlight.models import ReweightedViT
    from tests.helpers.models import micro_vit

    spec = ReweightingSpec(name)
    models = [TransformerLM(tiny_transformer(n_layers=1, attention=spec))]
    if name in NON_CAUSAL:
        models += [
            TransformerSeq2Seq(tiny_transformer(n_encoder_layers=1, n_layers=1, attention=spec, output_multimax=True)),
            ReweightedViT(micro_vit(attention=spec, output_multimax=True)),
        ]
    assert all(list(m.named_buffers()) == [] for m in models)


def test_each_attention_site_learns_one_value_per_head_and_only_decoder_self_attention_is_causal():
    """ssmax learns one value per head at every site (2 heads here: encoder, decoder and cross-attention);
    stick-breaking attends only to earlier keys, so the encoder's and the cross-attention's layers refuse it,
    each naming itself, while decoder self-attention takes it."""
    model = TransformerSeq2Seq(tiny(n_encoder_layers=1, name="ssmax"))
    assert {name: tuple(m.s.shape) for name, m in model.reweighting_sites().items()} == {
        "encoder.layers.0.self_attn": (2,),
        "decoder.layers.0.self_attn": (2,),
        "decoder.layers.0.cross_attn": (2,),
        "decoder.layers.1.self_attn": (2,),
        "decoder.layers.1.cross_attn": (2,),
    }
    with pytest.raises(ValueError) as refused:
        TransformerSeq2Seq(tiny(n_encoder_layers=1, name="stickbreaking"))
    assert str(refused.value).endswith(
        "the encoder self-attention is not causal (use it in decoder self-attention only)"
    )
    with pytest.raises(ValueError) as refused:
        DecoderLayer(tiny(name="stickbreaking"), cross=True)
    assert str(refused.value) == (
        "reweighting 'stickbreaking' attends only to earlier keys and needs causal attention; "
        "the cross-attention is not causal (use it in decoder self-attention only)"
    )
    assert isinstance(DecoderLayer(tiny(name="stickbreaking"), cross=False).self_attn.reweight, StickBreaking)
