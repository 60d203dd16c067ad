"""The Llama-style options of TransformerConfig (positions, norm, ffn, n_kv_heads, qk_norm, bias): each
layer against a hand computation, parameter counts, every reweighting function and gate with every
combination through the KV cache, and the earlier ``sinusoidal_positions`` spelling."""

import math
import pickle
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from mmlight.models.transformer import (
    LLAMA_STYLE,
    FeedForward,
    MultiHeadAttention,
    TransformerConfig,
    TransformerLM,
    TransformerSeq2Seq,
    norm_layer,
)
from mmlight.nn.rope import RotaryEmbedding
from mmlight.reweighting import MultiMax, ReweightingSpec, available
from mmlight.safe_load import load_checkpoint
from tests.helpers.models import PAD, tiny

#: three architectures crossing every option: fairseq's (the defaults), Llama-style with grouped-query
#: attention and QK-norm, and NoPE with GELU, multi-query attention, LayerNorm without bias
ARCHITECTURES = {
    "fairseq": {},
    "llama_gqa_qknorm": {**LLAMA_STYLE, "n_heads": 4, "n_kv_heads": 2, "qk_norm": True},
    "nope_gelu_mqa": {
        "pre_norm": True,
        "positions": "none",
        "ffn": "gelu",
        "n_heads": 4,
        "n_kv_heads": 1,
        "bias": False,
    },
}


def randomize(model, generator):
    """Move the reweighting parameters (MultiMax, sink logits, temperatures) off their initial values, so
    that every one of them matters in the comparisons."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MultiMax):
                m.ts.uniform_(-0.5, 0.5, generator=generator)
                m.ranges.uniform_(-1.0, 1.0, generator=generator)
            elif hasattr(m, "sink_logit"):
                m.sink_logit.uniform_(-1.0, 1.0, generator=generator)


# ---------------------------------------------------------------------------------------------
# Config


def test_defaults_are_fairseq_s_network():
    c = TransformerConfig(vocab_size=10)
    assert (c.positions, c.norm, c.ffn, c.n_kv_heads, c.qk_norm, c.bias) == (
        "sinusoidal",
        "layernorm",
        "relu",
        None,
        False,
        True,
    )
    assert (c.rope_theta, c.norm_eps, c.kv_heads, c.embed_scale) == (10_000.0, 1e-5, 8, None)


def test_the_earlier_spelling_of_positions_still_builds_the_same_network():
    assert tiny(sinusoidal_positions=False).positions == "learned"
    assert tiny(sinusoidal_positions=True).positions == "sinusoidal"
    assert tiny(positions="rope", rope_theta=0.5).rope_theta == 0.5  # any positive base, below 1 too
    with pytest.raises(
        ValueError, match="sinusoidal_positions=False contradicts positions='rope'; set positions only$"
    ):
        tiny(sinusoidal_positions=False, positions="rope")


def test_a_config_pickled_before_positions_existed_loads_with_its_positions(tmp_path):
    """A checkpoint's hyperparameters hold the config object: one saved by an earlier mmlight has
    ``sinusoidal_positions`` and no ``positions`` (built here by removing the new fields from its state)."""
    old = tiny(positions="learned")
    state = {k: v for k, v in vars(old).items() if k not in ("positions", "norm", "ffn", "n_kv_heads")}
    state["sinusoidal_positions"] = False
    old.__dict__.clear()
    old.__dict__.update(state)
    path = tmp_path / "old.ckpt"
    torch.save({"hyper_parameters": {"model": old}}, path)
    loaded = load_checkpoint(path)["hyper_parameters"]["model"]
    assert (loaded.positions, loaded.sinusoidal_positions, loaded.norm) == ("learned", None, "layernorm")
    assert pickle.loads(pickle.dumps(loaded)) == loaded


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"positions": "alibi"}, "positions must be one of"),
        ({"norm": "batchnorm"}, "norm must be one of"),
        ({"ffn": "swish"}, "ffn must be one of"),
        ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads=3 must be positive and divide n_heads=4"),
        ({"n_kv_heads": 0}, "n_kv_heads=0 must be positive"),
        ({"d_model": 30, "n_heads": 2, "positions": "rope"}, "even head dimension"),
        ({"rope_theta": -1.0}, "rope_theta and norm_eps must be positive"),
        ({"rope_theta": 0.0}, "rope_theta and norm_eps must be positive"),
        ({"norm_eps": 0.0}, "rope_theta and norm_eps must be positive"),
    ],
)
def test_bad_options_are_refused_when_the_config_is_made(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny(**fields)


def expected_params(c: TransformerConfig) -> int:
    """Parameters of an LM from its config, written out per option (independently of the modules)."""
    d, f, V, hs, b = c.d_model, c.ffn_dim, c.vocab_size, c.head_dim, int(c.bias)
    kv = c.kv_heads * hs
    attn = d * d + 2 * d * kv + d * d + b * (d + 2 * kv + d) + (2 * hs if c.qk_norm else 0)
    fc1 = (2 * f if c.ffn == "swiglu" else f) * (d + b)
    ffn = fc1 + f * d + b * d
    norm = d * (1 + b if c.norm == "layernorm" else 1)
    n = V * d + c.n_layers * (attn + ffn + 2 * norm) + (norm if c.pre_norm else 0)
    return n + (c.max_positions * d if c.positions == "learned" else 0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_parameter_count_of_each_architecture(arch):
    c = tiny(**ARCHITECTURES[arch])
    assert sum(p.numel() for p in TransformerLM(c).parameters()) == expected_params(c)


def test_a_config_without_biases_has_none_in_any_module_its_gates_included():
    for gate in ("headwise", "elementwise"):
        model = TransformerSeq2Seq(tiny(1, gate=gate, bias=False))
        assert [name for name, _ in model.named_parameters() if name.endswith("bias")] == []
        assert (
            sum(name.endswith(".gate.weight") for name, _ in model.named_parameters()) == 5
        )  # 1 encoder, 2 decoder layers


def test_the_layers_defaults_are_fairseqs_relu_feed_forward_and_attention_with_biases():
    torch.manual_seed(0)
    ffn = FeedForward(6, 10).double()
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    with torch.no_grad():
        ffn.fc1.bias.uniform_(-1, 1)
    want = F.relu(x @ ffn.fc1.weight.T + ffn.fc1.bias) @ ffn.fc2.weight.T + ffn.fc2.bias
    torch.testing.assert_close(ffn(x), want)
    layer = MultiHeadAttention(16, 4, ReweightingSpec().build())
    assert sum(p.numel() for p in layer.parameters()) == 4 * (16 * 16 + 16)  # q, k, v, out with biases


def layer_signature(layer: torch.nn.Module) -> dict[str, tuple]:
    """Each submodule's type, parameter shapes and epsilon, by name: what the config decides of a layer."""
    return {
        name: (type(m).__name__, [tuple(p.shape) for p in m.parameters(recurse=False)], getattr(m, "eps", None))
        for name, m in layer.named_modules()
        if name and "cross" not in name
    }


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_an_encoder_layer_takes_every_option_as_a_decoder_layer_does(arch):
    """An encoder-decoder's encoder layer has the norms (kind and epsilon), biases, heads and feed-forward of
    the same config's decoder layer (whose options the LM's parameter count checks), its cross-attention
    aside; norm_eps 1e-3, not the norms' own default, shows that the config's epsilon reaches both."""
    c = tiny(1, **{**ARCHITECTURES[arch], "norm_eps": 1e-3})
    model = TransformerSeq2Seq(c)
    encoder, decoder = layer_signature(model.encoder.layers[0]), layer_signature(model.decoder.layers[0])
    assert encoder == decoder
    assert {eps for *_, eps in encoder.values() if eps is not None} == {1e-3}


# ---------------------------------------------------------------------------------------------
# Layers against hand computations


def test_rmsnorm_and_bias_free_layernorm():
    """Both norms against their formulas, with an epsilon (0.5) large enough to change every value."""
    x = torch.randn(3, 8, dtype=torch.float64)
    rms = norm_layer(tiny(d_model=8, n_heads=2, norm="rmsnorm", norm_eps=0.5)).double()
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 0.5) * rms.weight
    torch.testing.assert_close(rms(x), want)
    ln = norm_layer(tiny(d_model=8, n_heads=2, bias=False, norm_eps=0.5)).double()
    assert isinstance(ln, torch.nn.LayerNorm) and ln.bias is None
    centred = x - x.mean(-1, keepdim=True)
    torch.testing.assert_close(ln(x), centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 0.5))


@pytest.mark.parametrize("kind", ["relu", "gelu", "swiglu"])
def test_feed_forward_kinds(kind):
    ffn = FeedForward(6, 10, kind=kind, bias=kind != "swiglu").double()
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    w1, w2 = ffn.fc1.weight, ffn.fc2.weight
    if kind == "swiglu":
        assert ffn.fc1.bias is None and w1.shape == (20, 6)
        want = (F.silu(x @ w1[:10].T) * (x @ w1[10:].T)) @ w2.T  # W2(silu(x W_gate) * x W_up)
    else:
        h = x @ w1.T + ffn.fc1.bias
        act = torch.relu(h) if kind == "relu" else 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        want = act @ w2.T + ffn.fc2.bias
    torch.testing.assert_close(ffn(x), want)


def test_grouped_query_layer_with_qk_norm_and_rope_by_hand():
    """4 query heads, 2 key/value heads, QK-norm then rotary positions, softmax, no bias: one head at a time."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(
        16, 4, ReweightingSpec().build(), n_kv_heads=2, bias=False, qk_norm_eps=1e-6, rope=RotaryEmbedding(4)
    ).double()
    with torch.no_grad():
        layer.q_norm.weight.uniform_(0.5, 1.5)
        layer.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 16, dtype=torch.float64)

    def rms(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rotate(t):  # t (T, 4): pairs (0, 2) and (1, 3) turned by p * theta^(-2c/4)
        out = t.clone()
        for p in range(t.shape[0]):
            for c in range(2):
                a = p * 10_000.0 ** (-2 * c / 4)
                out[p, c] = t[p, c] * math.cos(a) - t[p, c + 2] * math.sin(a)
                out[p, c + 2] = t[p, c] * math.sin(a) + t[p, c + 2] * math.cos(a)
        return out

    q, k, v = x @ layer.q_proj.weight.T, x @ layer.k_proj.weight.T, x @ layer.v_proj.weight.T
    heads = []
    for b in range(2):
        row = []
        for h in range(4):
            g = h // 2  # the key/value head of query head h
            qh = rotate(rms(q[b, :, 4 * h : 4 * h + 4], layer.q_norm.weight))
            kh = rotate(rms(k[b, :, 4 * g : 4 * g + 4], layer.k_norm.weight))
            scores = (qh @ kh.T) / 2.0 + torch.full((5, 5), float("-inf"), dtype=torch.float64).triu(1)
            row.append(torch.softmax(scores, -1) @ v[b, :, 4 * g : 4 * g + 4])
        heads.append(torch.cat(row, dim=-1))
    want = torch.stack(heads) @ layer.out_proj.weight.T
    torch.testing.assert_close(layer(x, is_causal=True), want)


def test_grouped_cross_attention_with_qk_norm_by_hand():
    """Cross-attention of 5 queries over 7 memory positions, 4 query heads on 2 key/value heads: the queries
    and the memory's keys both pass through their QK-norm (no rotary positions, no mask)."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(
        16, 4, ReweightingSpec().build(), cross=True, n_kv_heads=2, bias=False, qk_norm_eps=1e-6
    ).double()
    with torch.no_grad():
        layer.q_norm.weight.uniform_(0.5, 1.5)
        layer.k_norm.weight.uniform_(0.5, 1.5)
    x, memory = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)

    def rms(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    q, k, v = x @ layer.q_proj.weight.T, memory @ layer.k_proj.weight.T, memory @ layer.v_proj.weight.T
    heads = []
    for b in range(2):
        row = []
        for h in range(4):
            g = h // 2
            qh = rms(q[b, :, 4 * h : 4 * h + 4], layer.q_norm.weight)
            kh = rms(k[b, :, 4 * g : 4 * g + 4], layer.k_norm.weight)
            row.append(torch.softmax(qh @ kh.T / 2.0, -1) @ v[b, :, 4 * g : 4 * g + 4])
        heads.append(torch.cat(row, dim=-1))
    want = torch.stack(heads) @ layer.out_proj.weight.T
    torch.testing.assert_close(layer(x, memory), want)


def test_rotary_and_no_positions_have_no_length_limit_but_tables_do():
    x = torch.randint(2, 23, (1, 40))  # tiny's max_positions is 32
    for positions in ("rope", "none"):
        assert TransformerLM(tiny(positions=positions))(x).shape == (1, 40, 32)
    with pytest.raises(ValueError, match="exceed max_positions=32"):
        TransformerLM(tiny(positions="learned"))(x)


def test_cross_attention_gets_no_rotary_positions_but_self_attention_does():
    model = TransformerSeq2Seq(tiny(1, positions="rope"))
    layer = model.decoder.layers[0]
    assert layer.self_attn.rope is not None and layer.cross_attn.rope is None
    assert model.encoder.layers[0].self_attn.rope is not None


# ---------------------------------------------------------------------------------------------
# Every function and gate with every combination: incremental decoding equals the full forward


@pytest.mark.parametrize("name", available())
@pytest.mark.parametrize(
    "arch, gate", [("fairseq", "none"), ("llama_gqa_qknorm", "headwise"), ("nope_gelu_mqa", "elementwise")]
)
def test_every_function_and_gate_decode_through_the_cache_as_the_full_forward(arch, gate, name):
    """Float64, 2 rows (one with a padded position), a 5-token prompt then 5 single steps past the
    config's 8 positions where the positions allow; the gradient of the loss is finite everywhere.
    Each architecture with one gate kind (the gate is per layer, independent of the options)."""
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    fields = {**ARCHITECTURES[arch], "attention": ReweightingSpec(name), "gate": gate, "dropout": 0.0}
    fields["backend"] = "reference"  # the architecture is under test here, not the backends
    long = fields.get("positions") in ("rope", "none")
    model = TransformerLM(tiny(**fields, max_positions=8 if long else 16)).eval()
    randomize(model, g)
    x = torch.randint(2, 23, (2, 10), generator=g)
    x[1, 2] = PAD
    full = model(x)  # (B, T, d)
    cache = model.new_cache()
    steps = [model(x[:, :5], cache=cache)] + [model(x[:, t : t + 1], cache=cache) for t in range(5, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)
    assert cache.self_attn[0].k.shape[1] == model.config.kv_heads  # the cache holds the key/value heads only
    loss, _ = model.train().loss(x, torch.roll(x, -1, 1))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", ["softmax", "multimax", "sink"])
def test_encoder_decoder_with_llama_options_decodes_through_the_cache(name):
    torch.set_default_dtype(torch.float64)
    fields = {**ARCHITECTURES["llama_gqa_qknorm"], "attention": ReweightingSpec(name), "share_embeddings": True}
    model = TransformerSeq2Seq(tiny(2, **fields)).eval()
    randomize(model, torch.Generator().manual_seed(1))
    src, tgt = torch.randint(2, 23, (3, 5)), torch.randint(2, 23, (3, 6))
    src[0, 3:] = PAD
    src_mask = model.source_mask(src)
    memory = model.encode(src, src_mask)
    full = model.decode(tgt, memory, src_mask)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t : t + 1], memory, src_mask, cache=cache) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)
    assert cache.cross_attn[0].k.shape == (3, 2, 5, 8)  # 2 key/value heads of width 8


def test_llama_style_block_is_what_it_says():
    """The block documented for Llama-style decoders (docs/llm.md renders it from LLAMA_STYLE)."""
    c = tiny(**LLAMA_STYLE)
    assert (c.pre_norm, c.positions, c.norm, c.ffn, c.bias, c.embed_scale) == (
        True,
        "rope",
        "rmsnorm",
        "swiglu",
        False,
        1.0,
    )
    assert set(LLAMA_STYLE) <= set(asdict(c))


def test_the_documented_llama_block_is_llama_style():
    """docs/llm.md's block to paste is LLAMA_STYLE, option for option."""
    import re
    from pathlib import Path

    import yaml

    doc = (Path(__file__).resolve().parents[2] / "docs" / "llm.md").read_text()
    section = doc.split("## The Llama-style decoder", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    assert yaml.safe_load(block) == LLAMA_STYLE
