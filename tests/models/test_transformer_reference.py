"""The transformer against its definition written out independently: fairseq's sinusoidal table, the
sqrt(d) embedding scale, pre- and post-norm placement, and whole forward passes of the LM and the
encoder-decoder recomputed from their weights in float64 (attention, masks, layer order, tied
output); plus fairseq's initialisation."""

import math

import numpy as np
import pytest
import torch

from mmlight.models.transformer import (
    Residual,
    TokenPositionEmbedding,
    TransformerConfig,
    TransformerLM,
    TransformerSeq2Seq,
    sinusoidal_table,
    token_embedding,
)

PAD = 1


def fairseq_sinusoids(n_positions: int, dim: int) -> np.ndarray:
    """fairseq's ``SinusoidalPositionalEmbedding.get_embedding``, element by element: channel ``i`` of
    the first half is ``sin(p * 10000 ** (-i / (half - 1)))``, channel ``half + i`` the cosine, and an
    odd ``dim`` leaves a zero last channel."""
    half = dim // 2
    table = np.zeros((n_positions, dim))
    for p in range(n_positions):
        for i in range(half):
            angle = p * 10000.0 ** (-i / (half - 1))
            table[p, i], table[p, half + i] = math.sin(angle), math.cos(angle)
    return table


@pytest.mark.parametrize("n_positions, dim", [(50, 16), (9, 7), (4, 4)])
def test_sinusoidal_table_is_fairseqs(n_positions, dim):
    np.testing.assert_allclose(
        sinusoidal_table(n_positions, dim).numpy(), fairseq_sinusoids(n_positions, dim), atol=2e-5, rtol=0
    )


def config(**overrides) -> TransformerConfig:
    base = dict(vocab_size=13, d_model=8, n_heads=2, ffn_dim=12, n_layers=2, dropout=0.0, max_positions=12, pad_id=PAD)
    return TransformerConfig(**{**base, **overrides})


@pytest.mark.parametrize("scale", [None, 1.0, 0.5])
def test_token_embedding_scale_and_positions(scale):
    c = config(embed_scale=scale)
    tokens = token_embedding(c.vocab_size, c.d_model, PAD)
    embed = TokenPositionEmbedding(tokens, c)
    ids = torch.tensor([[3, 4, PAD, 5]])
    factor = math.sqrt(8) if scale is None else scale
    positions = fairseq_sinusoids(12, 8)
    for start in (0, 5):
        got = embed(ids, start=start)[0].double().detach().numpy()
        want = factor * tokens.weight[ids[0]].double().detach().numpy() + positions[start : start + 4]
        np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="positions up to 13 exceed max_positions=12"):
        embed(ids, start=9)
    embed(ids, start=8)  # positions 8..11: the last ones there are


def test_learned_positions():
    c = config(positions="learned")
    tokens = token_embedding(c.vocab_size, c.d_model, PAD)
    embed = TokenPositionEmbedding(tokens, c)
    ids = torch.tensor([[3, 4, 6]])
    want = math.sqrt(8) * tokens.weight[ids[0]] + embed.positions.weight[2:5]
    torch.testing.assert_close(embed(ids, start=2)[0], want)


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


@pytest.mark.parametrize("pre_norm", [False, True])
def test_residual_norm_placement(pre_norm):
    block = Residual(torch.nn.LayerNorm(6), dropout=0.0, pre_norm=pre_norm).double()
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
        block.norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    sublayer = lambda h: torch.tanh(2 * h) + 1  # noqa: E731
    want = x + sublayer(layer_norm(x, block.norm)) if pre_norm else layer_norm(x + sublayer(x), block.norm)
    torch.testing.assert_close(block(x, sublayer), want)


# ------------------------------------------------------------------ whole models, from their weights


def attend(h, memory, keep, causal, mha, n_heads):
    """Multi-head softmax attention of ``mha``'s weights, written out: queries from ``h`` (B, T, d),
    keys and values from ``memory`` (B, S, d); ``keep`` (B, S) masks keys; ``causal`` masks the future."""
    B, T, d = h.shape
    S = memory.shape[1]
    hs = d // n_heads
    lin = lambda x, p: x @ p.weight.T + p.bias  # noqa: E731
    split = lambda x, n: x.reshape(B, n, n_heads, hs).permute(0, 2, 1, 3)  # noqa: E731
    q, k, v = split(lin(h, mha.q_proj), T), split(lin(memory, mha.k_proj), S), split(lin(memory, mha.v_proj), S)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hs)  # (B, nh, T, S)
    allowed = keep[:, None, None, :].expand(B, 1, T, S)
    if causal:
        allowed = allowed & torch.ones(T, S, dtype=torch.bool).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key attends to nothing
    y = (weights @ v).permute(0, 2, 1, 3).reshape(B, T, d)
    return lin(y, mha.out_proj)


def sublayer(x, f, norm, pre_norm):
    return x + f(layer_norm(x, norm)) if pre_norm else layer_norm(x + f(x), norm)


def ffn(x, layer):
    return torch.relu(x @ layer.fc1.weight.T + layer.fc1.bias) @ layer.fc2.weight.T + layer.fc2.bias


def embed(ids, table, c):
    return math.sqrt(c.d_model) * table.weight[ids] + torch.as_tensor(fairseq_sinusoids(ids.shape[1], c.d_model))


def reference_decoder(x, tgt_keep, layers, c, memory=None, src_keep=None, final_norm=None):
    for layer in layers:
        x = sublayer(
            x, lambda h: attend(h, h, tgt_keep, True, layer.self_attn, c.n_heads), layer.attn_block.norm, c.pre_norm
        )
        if memory is not None:
            x = sublayer(
                x,
                lambda h: attend(h, memory, src_keep, False, layer.cross_attn, c.n_heads),
                layer.cross_block.norm,
                c.pre_norm,
            )
        x = sublayer(x, lambda h: ffn(h, layer.ffn), layer.ffn_block.norm, c.pre_norm)
    return x if final_norm is None else layer_norm(x, final_norm)


def randomize_norms(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)


@pytest.mark.parametrize("pre_norm", [False, True])
def test_lm_forward_equals_its_definition(pre_norm):
    torch.manual_seed(0)
    c = config(pre_norm=pre_norm)
    model = TransformerLM(c).double().eval()
    randomize_norms(model)
    ids = torch.tensor([[2, 5, 7, 3, 9], [4, 4, 8, PAD, PAD]])
    with torch.no_grad():
        got = model.logits(model(ids))
        dec = model.decoder
        hidden = reference_decoder(
            embed(ids, dec.embed.tokens, c), ids != PAD, dec.layers, c, final_norm=dec.norm if pre_norm else None
        )
        want = hidden @ dec.embed.tokens.weight.T  # the output projection is the input embedding
    assert (dec.norm is not None) == pre_norm
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the sinusoids are float32


@pytest.mark.parametrize("pre_norm", [False, True])
def test_seq2seq_forward_equals_its_definition(pre_norm):
    torch.manual_seed(0)
    c = config(pre_norm=pre_norm, n_encoder_layers=2, n_layers=1)
    model = TransformerSeq2Seq(c).double().eval()
    randomize_norms(model)
    src = torch.tensor([[3, 6, 9, 2], [5, 7, PAD, PAD]])
    tgt = torch.tensor([[2, 4, 8], [2, 11, PAD]])  # a padded target: its key is masked
    enc, dec = model.encoder, model.decoder

    def reference(src_keep):
        x = embed(src, enc.embed.tokens, c)
        for layer in enc.layers:  # no causal mask in the encoder
            x = sublayer(
                x, lambda h: attend(h, h, src_keep, False, layer.self_attn, c.n_heads), layer.attn_block.norm, pre_norm
            )
            x = sublayer(x, lambda h: ffn(h, layer.ffn), layer.ffn_block.norm, pre_norm)
        memory = x if enc.norm is None else layer_norm(x, enc.norm)
        hidden = reference_decoder(
            embed(tgt, dec.embed.tokens, c),
            tgt != PAD,
            dec.layers,
            c,
            memory,
            src_keep,
            final_norm=dec.norm if pre_norm else None,
        )
        return memory, hidden @ dec.embed.tokens.weight.T

    assert (enc.norm is not None) == (dec.norm is not None) == pre_norm
    hidden_too = src != PAD
    hidden_too[0, 1] = False  # a source mask given by the caller, hiding a real token too
    with torch.no_grad():
        for src_mask, src_keep in ((None, src != PAD), (hidden_too, hidden_too)):
            memory, want = reference(src_keep)
            got = model.logits(model(src, tgt, src_mask))
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the sinusoids are float32
            torch.testing.assert_close(model.encode(src, src_mask), memory, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model.encode(src), reference(src != PAD)[0], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ initialisation


def xavier_bound(weight: torch.Tensor, gain: float) -> float:
    fan_out, fan_in = weight.shape
    return gain * math.sqrt(6.0 / (fan_in + fan_out))


def test_fairseq_initialisation():
    torch.manual_seed(0)
    d = 64
    model = TransformerSeq2Seq(
        config(
            d_model=d,
            n_heads=4,
            ffn_dim=96,
            vocab_size=400,
            n_encoder_layers=1,
            n_layers=1,
            share_output_embedding=False,
            max_positions=300,
            positions="learned",
        )
    )
    attn = model.decoder.layers[0].self_attn
    for proj, gain in ((attn.q_proj, 2**-0.5), (attn.k_proj, 2**-0.5), (attn.v_proj, 2**-0.5), (attn.out_proj, 1.0)):
        bound = xavier_bound(proj.weight, gain)
        assert proj.weight.abs().max() <= bound and proj.weight.abs().max() > 0.95 * bound  # U(-bound, bound)
        assert proj.bias.abs().max() == 0
    for fc in (model.decoder.layers[0].ffn.fc1, model.decoder.layers[0].ffn.fc2):
        bound = xavier_bound(fc.weight, 1.0)
        assert fc.weight.abs().max() <= bound and fc.weight.abs().max() > 0.95 * bound and fc.bias.abs().max() == 0
    for table in (
        model.decoder.embed.tokens.weight,
        model.encoder.embed.tokens.weight,
        model.output_projection.weight,
        model.decoder.embed.positions.weight,
    ):
        rows = [
            r
            for r in range(table.shape[0])
            if not (
                r == PAD
                and table is not model.output_projection.weight
                and table is not model.decoder.embed.positions.weight
            )
        ]
        assert table[rows].std().item() == pytest.approx(d**-0.5, rel=0.05)
    assert (
        model.decoder.embed.tokens.weight[PAD].abs().max() == 0
        and model.encoder.embed.tokens.weight[PAD].abs().max() == 0
    )
    assert model.output_projection.weight is not model.decoder.embed.tokens.weight
    assert model.encoder.embed.tokens is not model.decoder.embed.tokens  # share_embeddings is off
    lm = TransformerLM(config(d_model=d, n_heads=4, vocab_size=400)).decoder.embed.tokens
    assert lm.padding_idx == PAD and lm.weight[PAD].abs().max() == 0
    lm(torch.tensor([[PAD, 3, PAD]])).sum().backward()
    assert lm.weight.grad[PAD].abs().max() == 0 and lm.weight.grad[3].abs().min() > 0  # no gradient to padding
    assert lm.weight[[r for r in range(400) if r != PAD]].std().item() == pytest.approx(d**-0.5, rel=0.05)
