"""mmlight's KV scoring functions against kvpress's presses on a tiny random transformers Llama (4 query
heads, 2 KV heads, rotary positions): at compression ratio 0.5 (keep ratio 0.5) each keeps the same
key positions per layer and KV head. The same on an mmlight Llama-style LM exported to transformers, with
mmlight's methods run on the mmlight model itself."""

from __future__ import annotations

import pytest
import torch

from mmlight.analysis import kv_eviction as kv

kvpress = pytest.importorskip("kvpress")
transformers = pytest.importorskip("transformers")

T, RATIO = 64, 0.5


@pytest.fixture(scope="module")
def llama():
    """The model, its tokens, and per layer the attention input, keys and values of a full prefill."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10_000.0,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, 50, (1, T))
    hidden = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: hidden.__setitem__(i, kw["hidden_states"].detach()), with_kwargs=True
        )
        for i, layer in enumerate(model.model.layers)
    ]
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        model(tokens, past_key_values=cache, use_cache=True)
    for h in hooks:
        h.remove()
    layers = [(hidden[i], cache.layers[i].keys, cache.layers[i].values) for i in range(2)]
    return model, tokens, layers


def kept_by(press, model, tokens, layers) -> list[torch.Tensor]:
    """Per layer, ``(1, n_kv, n_kept)`` sorted positions kvpress keeps (its kept keys matched to the full ones)."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), press(model):
        model(tokens, past_key_values=cache, use_cache=True)
    out = []
    for i, (_, keys, _) in enumerate(layers):
        kept = cache.layers[i].keys  # (1, n_kv, n_kept, hs)
        match = (kept[:, :, :, None] - keys[:, :, None]).abs().amax(-1) < 1e-6  # (1, n_kv, n_kept, T)
        assert bool((match.sum(-1) == 1).all())
        out.append(match.float().argmax(-1).sort(-1).values)
    return out


def kept_from(scores: torch.Tensor) -> torch.Tensor:
    """mmlight's choice from scores ``(1, n_kv, T)``: its keep_top over all T keys at the same ratio."""
    past = torch.ones(scores.shape[0], scores.shape[1], 1, scores.shape[-1], dtype=torch.bool)
    kept = kv.keep_top(scores[:, :, None], past, RATIO)[:, :, 0]  # (1, n_kv, T)
    return kept.nonzero()[:, 2].view(scores.shape[0], scores.shape[1], -1)


def test_the_budgets_agree_where_r_times_n_is_whole():
    assert int(kv.budget(torch.tensor(T), RATIO)) == int(T * (1 - kv.compression_ratio(RATIO)))


def test_key_norm_and_streaming_keep_what_kvpress_keeps(llama):
    model, tokens, layers = llama
    got = kept_by(kvpress.KnormPress(compression_ratio=kv.compression_ratio(RATIO)), model, tokens, layers)
    for (_, keys, _), want in zip(layers, got):
        assert torch.equal(kept_from(kv.l2_scores(keys)), want)
    got = kept_by(kvpress.StreamingLLMPress(compression_ratio=kv.compression_ratio(RATIO)), model, tokens, layers)
    for (_, keys, _), want in zip(layers, got):
        past = torch.ones(keys.shape[:3], dtype=torch.bool)
        assert torch.equal(kept_from(kv.streaming_scores(past)), want)


class GivenFilters(kvpress.QFilterPress):
    """QFilterPress with filters set by the test (its own loader downloads them by model name)."""

    def post_init_from_model(self, model):
        pass


def test_qfilters_keep_what_kvpress_keeps_with_the_opposite_sign(llama):
    """Filters from each KV group's queries by mmlight's rule (queries project positively); kvpress
    scores -<k, f>, so it is given -f."""
    model, tokens, layers = llama
    filters = []
    for layer, (hidden, _, _) in zip(model.model.layers, layers):
        q = layer.self_attn.q_proj(hidden).view(T, 2, 2, 16)  # (T, n_kv, group, hs)
        filters.append(torch.stack([kv.qfilters(q[:, g].reshape(-1, 16).detach()) for g in range(2)]))
    filters = torch.stack(filters).float()  # (L, n_kv, hs)
    press = GivenFilters(compression_ratio=kv.compression_ratio(RATIO))
    press.q_filters = -filters
    got = kept_by(press, model, tokens, layers)
    for i, ((_, keys, _), want) in enumerate(zip(layers, got)):
        assert torch.equal(kept_from(kv.qfilter_scores(keys, filters[i])), want)


def test_expected_attention_keeps_what_kvpress_keeps_under_its_conventions(llama):
    """kvpress's ExpectedAttentionPress: statistics over every position after the 4 sinks, the rotary
    matrix averaged over the 512 positions after the prefill, values weighed by ||v||. mmlight's
    functions with those settings keep the same keys; with ||W_O v|` (mmlight's default, thesis Eq.
    4.11) the choice differs, which the test shows."""
    model, tokens, layers = llama
    press = kvpress.ExpectedAttentionPress(compression_ratio=kv.compression_ratio(RATIO))
    got = kept_by(press, model, tokens, layers)
    differs = 0
    for layer, (hidden, keys, values), want in zip(model.model.layers, layers, got):
        attn = layer.self_attn
        mu, sigma = kv.query_statistics(hidden[:, kv.N_SINK :], attn.q_proj.weight, attn.q_proj.bias, 4)
        rot = kv.rotary_average(T - 1, 512, 16, model.config.rope_parameters["rope_theta"])
        mu, sigma = mu @ rot.T, rot @ sigma @ rot.T
        logits = kv.expected_logits(keys.repeat_interleave(2, dim=1), mu, sigma)  # (1, 4, T)
        sinks = torch.arange(T) < kv.N_SINK
        v_norms = values.norm(dim=-1).repeat_interleave(2, dim=1)  # (1, 4, T): kvpress's ||v||
        scores = kv.expected_attention_scores(logits, ~sinks, v_norms, 2).masked_fill(sinks, torch.inf)
        assert torch.equal(kept_from(scores), want)
        wo = kv.out_value_norms(values, attn.o_proj.weight, 4)
        thesis = kv.expected_attention_scores(logits, ~sinks, wo, 2).masked_fill(sinks, torch.inf)
        differs += int((kept_from(thesis) != want).any())
    assert differs > 0  # ||W_O v|| and ||v|| rank the keys differently


# ----------------------------------------------------------------------------------------------
# An mmlight Llama-style LM exported to transformers: kvpress's presses on the export keep what mmlight's
# methods keep on the mmlight model itself (through its attention modules and observer).


@pytest.fixture(scope="module")
def exported():
    """An mmlight LLAMA_STYLE LM (4 query heads over 2 KV heads, rotary positions), its transformers export,
    T distinct tokens and, per layer of a full prefill of the export, ``(None, keys, values)``."""
    from mmlight.export.hf import to_hf
    from mmlight.models.transformer import LLAMA_STYLE, TransformerLM
    from tests.helpers.models import tiny_transformer

    torch.manual_seed(0)
    config = tiny_transformer(
        **LLAMA_STYLE, vocab_size=100, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, max_positions=T
    )
    model = TransformerLM(config).eval()
    hf = to_hf(model)
    # distinct tokens, none the padding id (1): a repeated token has keys of equal norm in layer 0 (a tie)
    tokens = 2 + torch.randperm(98)[:T][None]
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(tokens, past_key_values=cache, use_cache=True)
    return model, hf, tokens, [(None, cache.layers[i].keys, cache.layers[i].values) for i in range(2)]


class LastRow(kv.EvictionMethod):
    """Wraps a method and records, per layer, its scores for the last query over every key (the query's
    own included), one row per KV head ``(B, n_kv, T)``."""

    def __init__(self, inner: kv.EvictionMethod, n_kv: int):
        self.inner, self.n_kv, self.rows = inner, n_kv, {}

    def attached(self, network):
        return self.inner.attached(network)

    def scores(self, call):
        s = torch.as_tensor(self.inner.scores(call)).double()
        s = s.expand(s.shape[0], s.shape[1], *call.keys.shape[2:])[:, :, -1]  # (B, h, Tk)
        self.rows[call.site.layer] = s[:, :: s.shape[1] // self.n_kv]  # heads of a KV group score alike
        return s[:, :, None]


def kept_by_mmlight(model, tokens, method: kv.EvictionMethod) -> list[torch.Tensor]:
    """Per layer, the positions mmlight's ``method`` keeps at RATIO among all T keys, scored by the last
    query in a teacher-forced pass (keep ratio 1.0: the pass is the full one, as kvpress's prefill)."""
    from mmlight.nn.attention import observe_attention

    recorder = LastRow(method, model.config.kv_heads)
    with torch.no_grad(), observe_attention(model, kv.KVEviction(1.0, recorder, skip_layers=0)):
        model(tokens)
    return [kept_from(recorder.rows[layer]) for layer in sorted(recorder.rows)]


def test_an_exported_mmlight_llama_keeps_under_kvpress_what_mmlight_keeps(exported):
    """Key norm, StreamingLLM, Expected Attention with kvpress's ||v|| (``value_norm="value"``) and
    Q-Filters calibrated by mmlight on the mmlight model (given to kvpress with the opposite sign): the
    same key positions per layer and KV head at compression ratio 0.5. Expected Attention with
    ``||W_O v||`` (mmlight's default, thesis Eq. 4.11) keeps other keys, which the test shows."""
    from mmlight.tasks import LanguageModel

    model, hf, tokens, layers = exported
    cr = kv.compression_ratio(RATIO)
    task = LanguageModel(model.config)
    task.model.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    calibration = torch.randint(2, 100, (6, T), generator=g)
    batch = {"input": calibration, "target": calibration.roll(-1, 1), "loss_mask": torch.ones_like(calibration) > 0}
    filters = kv.calibrate_qfilters(task, [batch])["filters"]  # (L, n_kv, hs), from the rotated queries
    given = GivenFilters(compression_ratio=cr)
    given.q_filters = -filters
    pairs = [
        (kvpress.KnormPress(compression_ratio=cr), kv.L2Norm()),
        (kvpress.StreamingLLMPress(compression_ratio=cr), kv.Streaming()),
        (kvpress.ExpectedAttentionPress(compression_ratio=cr), kv.ExpectedAttention(value_norm="value")),
        (given, kv.QFilters(filters)),
    ]
    for press, method in pairs:
        want = kept_by(press, hf, tokens, layers)
        got = kept_by_mmlight(model, tokens, method)
        for layer, (g_, w_) in enumerate(zip(got, want)):
            assert torch.equal(g_, w_), (type(press).__name__, layer)
    want = kept_by(kvpress.ExpectedAttentionPress(compression_ratio=cr), hf, tokens, layers)
    thesis = kept_by_mmlight(model, tokens, kv.ExpectedAttention())
    assert any(not torch.equal(a, b) for a, b in zip(thesis, want))  # ||W_O v|| and ||v|| rank keys differently
