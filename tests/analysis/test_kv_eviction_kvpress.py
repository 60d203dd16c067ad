"""mmlight's KV scoring functions against kvpress's presses on a tiny random transformers Llama (4 query
heads, 2 KV heads, rotary positions): at compression ratio 0.5 (keep ratio 0.5) each keeps the same
key positions per layer and KV head."""

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
