"""KV eviction methods: each scoring function against a brute-force or float64 computation, the oracle's
attention loss against exhaustive search, incremental decoding against teacher forcing, and the
methods against kvpress's presses on a tiny transformers Llama."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mmlight.analysis import kv_eviction as kv
from mmlight.nn.attention import causal_mask
from mmlight.nn.sites import AttentionSite
from mmlight.reweighting import Softmax
from tests.helpers.models import tiny_transformer


def site(layer=0, module=None):
    return AttentionSite("decoder.layers.0.self_attn", "decoder_self", "decoder", layer, module or Softmax())


def test_every_method_is_registered_and_unknown_names_are_refused():
    assert list(kv.METHODS) == ["l2", "streaming", "oracle", "random", "qfilters", "expected_attention"]
    with pytest.raises(ValueError, match="qfilters needs calibrated filters"):
        kv.method("qfilters")


def test_oracle_loses_least_attention_exhaustively():
    """Toy calls (5 keys, causal, 2 heads): for each query and budget, the oracle's attention loss equals
    the least over every subset of that size, and no other method's is below it."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 5, 4, dtype=torch.float64), torch.randn(1, 2, 5, 4, dtype=torch.float64)
    mask = causal_mask(5, 5)
    weights = (q @ k.transpose(-1, -2) / 2).masked_fill(~mask, -math.inf).softmax(-1)
    for ratio in (0.3, 0.5, 0.7):
        losses = {}
        for name in ("l2", "streaming", "oracle", "random"):
            evict = kv.KVEviction(ratio, name, skip_layers=0, measure_loss=True)
            evict.edit_mask(site(), q, k, mask)
            losses[name] = evict.loss[0][0] / evict.loss[0][1]
        best = 0.0
        for h, i in itertools.product(range(2), range(1, 5)):
            n = int(kv.budget(torch.tensor(i), ratio))
            best += min(1 - float(weights[0, h, i, list(s) + [i]].sum()) for s in itertools.combinations(range(i), n))
        rows = 2 * 5  # query 0 has no past key but its row has mass, so it counts with loss 0
        assert losses["oracle"] == pytest.approx(best / rows, abs=1e-9)
        assert all(loss >= losses["oracle"] - 1e-12 for loss in losses.values())


def test_gaussian_expected_logit_matches_monte_carlo():
    """log E[exp(q.k/sqrt d)] for q ~ N(mu, Sigma), by 400k samples in float64, within 1%."""
    g = torch.Generator().manual_seed(1)
    d = 4
    mu = torch.randn(1, 1, d, generator=g, dtype=torch.float64)
    a = torch.randn(d, d, generator=g, dtype=torch.float64) * 0.3
    sigma = (a @ a.T)[None, None]
    keys = torch.randn(1, 1, 3, d, generator=g, dtype=torch.float64) * 0.7
    q = torch.distributions.MultivariateNormal(mu[0, 0], sigma[0, 0]).sample((400_000,))
    mc = ((q @ keys[0, 0].T) / d**0.5).exp().mean(0).log()
    assert torch.allclose(kv.expected_logits(keys, mu, sigma)[0, 0], mc, rtol=0, atol=0.01)


def test_query_statistics_are_those_of_the_projected_hidden_states():
    g = torch.Generator().manual_seed(2)
    hidden, w, b = torch.randn(2, 9, 6, generator=g), torch.randn(4, 6, generator=g), torch.randn(4, generator=g)
    mu, sigma = kv.query_statistics(hidden, w, b, n_heads=2)
    q = (hidden.double() @ w.double().T + b.double()).view(2, 9, 2, 2)  # (B, N, nh, hs)
    for bi, h in itertools.product(range(2), range(2)):
        x = q[bi, :, h]
        assert torch.allclose(mu[bi, h], x.mean(0))
        assert torch.allclose(sigma[bi, h], torch.cov(x.T, correction=0))


def test_running_statistics_against_each_window():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 11, 4, generator=g)
    chunks = list(kv.running_statistics(q, start=2, first=0, chunk_bytes=8 * 2 * 3 * 16 * 3))  # 3 queries a chunk
    assert len(chunks) == 4
    for ends, mu, sigma in chunks:
        for j, e in enumerate(ends.tolist()):
            x = q[:, :, 2 : e + 1].double()
            if x.shape[2] == 0:
                assert not mu[:, :, j].any() and not sigma[:, :, j].any()
                continue
            m = x.mean(2)
            assert torch.allclose(mu[:, :, j], m)
            c = x - m[:, :, None]
            assert torch.allclose(sigma[:, :, j], torch.einsum("bhte,bhtf->bhef", c, c) / x.shape[2])


def rope_matrix(pos: float, hs: int, theta: float) -> torch.Tensor:
    """The rotation applied to a (pre-rotary) vector at ``pos``, built from the rotate_half formula
    x * cos + rotate_half(x) * sin applied to each basis vector."""
    inv = theta ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    ang = torch.cat([pos * inv, pos * inv])
    eye = torch.eye(hs, dtype=torch.float64)
    rotated = torch.cat([-eye[:, hs // 2 :], eye[:, : hs // 2]], dim=1)  # rotate_half of each row
    return (eye * ang.cos() + rotated * ang.sin()).T


def test_rotary_average_is_the_mean_rotation_and_identity_for_additive_positions():
    assert torch.equal(kv.rotary_average(7, 16, 8, None), torch.eye(8, dtype=torch.float64))
    want = torch.stack([rope_matrix(5 + 1 + t, 8, 100.0) for t in range(16)]).mean(0)
    assert torch.allclose(kv.rotary_average(5, 16, 8, 100.0), want)
    both = kv.rotary_average(torch.tensor([5, 9]), 16, 8, 100.0)
    assert both.shape == (2, 8, 8) and torch.allclose(both[0], want)


def test_qfilter_is_the_signed_first_singular_vector():
    g = torch.Generator().manual_seed(4)
    direction = torch.tensor([3.0, -1.0, 0.5])
    queries = -direction * (2 + torch.rand(200, 1, generator=g)) + 0.1 * torch.randn(200, 3, generator=g)
    f = kv.qfilters(queries)
    assert (queries.double() @ f).mean() > 0  # the sign rule
    assert torch.allclose(f.abs(), (direction / direction.norm()).double().abs(), atol=0.02)
    _, _, vh = torch.linalg.svd(queries.double())
    assert torch.allclose(f.abs(), vh[0].abs())


def test_a_setting_that_evicts_nothing_is_refused_naming_the_layers():
    from mmlight.tasks import LanguageModel

    task = LanguageModel(tiny_transformer())  # 2 layers
    with pytest.raises(ValueError, match=r"--kv_skip_layers 2 leaves no layer to evict in: .* layers \[0, 1\]"):
        kv.check_evictable(task, 2)
    kv.check_evictable(task, 1)


class Recording(kv.KVEviction):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.masks = []

    def edit_mask(self, site, q, k, mask):
        out = super().edit_mask(site, q, k, mask)
        if site.kind == "decoder_self" and site.layer >= self.skip_layers:
            self.masks.append(out)
        return out


@pytest.mark.parametrize("name", ["expected_attention", "l2", "streaming", "oracle"])
def test_incremental_decoding_with_a_reordered_cache_sees_what_teacher_forcing_sees(name):
    """The LM decoded token by token through its KV cache, with the cache rows permuted midway (as beam
    search does), keeps for each query the keys it keeps teacher-forced."""
    from mmlight.models.transformer import TransformerLM
    from mmlight.nn.attention import observe_attention

    torch.manual_seed(5)
    net = TransformerLM(tiny_transformer(dropout=0.0)).eval()
    tokens = torch.randint(1, 20, (3, 12))
    full = Recording(0.5, kv.method(name, n_sink=2) if name == "expected_attention" else name, skip_layers=1)
    with torch.no_grad(), observe_attention(net, full):
        net(tokens)
    step = Recording(0.5, kv.method(name, n_sink=2) if name == "expected_attention" else name, skip_layers=1)
    perm = torch.tensor([2, 0, 1])
    with torch.no_grad(), observe_attention(net, step):
        cache, rows = net.new_cache(), torch.arange(3)
        for t in range(12):
            if t == 6:
                net.reorder_cache(cache, perm)
                rows = rows[perm]
            net(tokens[rows, t : t + 1], cache)
    for t, mask in enumerate(step.masks):
        want = full.masks[0][rows if t >= 6 else torch.arange(3), :, t : t + 1, : t + 1]
        assert torch.equal(mask, want), t


def test_translator_beam_search_runs_under_every_method():
    """Beam search (3 beams, reordered every step) under each method: ratio 1 translates as without
    eviction; ratio 0.3 evicts in every call of layer 1."""
    from mmlight.models.beam_search import BeamSearchConfig, beam_search
    from mmlight.models.transformer import TransformerSeq2Seq
    from mmlight.nn.attention import observe_attention

    torch.manual_seed(6)
    net = TransformerSeq2Seq(tiny_transformer(n_layers=2, n_encoder_layers=1, dropout=0.0)).eval()
    src = torch.randint(4, 20, (2, 7))
    ids = {"start_id": 2, "eos_id": 2, "pad_id": 1}
    config = BeamSearchConfig(beam_size=3, max_len_a=0, max_len_b=8, min_len=7)
    with torch.no_grad():
        plain = [h.tolist() for h in beam_search(net, src, None, config, **ids)[0]]
        for name in ("expected_attention", "oracle"):
            with observe_attention(net, kv.KVEviction(1.0, name, skip_layers=1)):
                assert [h.tolist() for h in beam_search(net, src, None, config, **ids)[0]] == plain
            evict = Recording(0.3, name, skip_layers=1)
            with observe_attention(net, evict):
                beam_search(net, src, None, config, **ids)
            seen = [m[:, :, -1].sum(-1) for m in evict.masks]  # (B, nh) keys seen at each step
            assert len(seen) >= 7 and all((s == 1 + kv.budget(torch.tensor(t), 0.3)).all() for t, s in enumerate(seen))


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qk-norm"])
def test_expected_attention_through_the_cache_of_a_rotary_grouped_query_lm_equals_teacher_forcing(qk_norm):
    """A Llama-style LM (rotary positions, 4 query heads over 2 key/value heads, with and without QK-norm)
    decoded token by token through its KV cache under Expected Attention gives the teacher-forced
    log-probabilities under the same eviction (float64, past ``max_positions``); the method reads the
    layer's rotary base and query norm."""
    from mmlight.models.transformer import LLAMA_STYLE, TransformerLM
    from mmlight.nn.attention import observe_attention
    from tests.helpers.models import tiny

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        config = tiny(**{**LLAMA_STYLE, "rope_theta": 100.0}, n_heads=4, n_kv_heads=2, max_positions=8, qk_norm=qk_norm)
        model = TransformerLM(config).eval()
        x = torch.randint(2, 23, (2, 12))
        attn = model.decoder.layers[1].self_attn
        parts = kv.attention_parts(attn)
        assert parts["theta"] == 100.0 and parts["n_kv_heads"] == 2 and parts["q_norm"] is attn.q_norm

        def observer():
            return Recording(0.5, kv.method("expected_attention", n_sink=2, future=16), skip_layers=0)

        full = observer()
        with torch.no_grad(), observe_attention(model, full):
            want = model.logits(model(x)).log_softmax(-1)  # (B, T, V)
        step = observer()
        with torch.no_grad(), observe_attention(model, step):
            cache = model.new_cache()
            got = torch.cat([model.logits(model(x[:, t : t + 1], cache=cache)).log_softmax(-1) for t in range(12)], 1)
    finally:
        torch.set_default_dtype(torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    keep = full.masks[1]  # layer 1, (B, nh, T, T)
    assert torch.equal(keep[:, 0], keep[:, 1]) and torch.equal(keep[:, 2], keep[:, 3])
    assert keep[:, :, -1].sum(-1).tolist() == [[7] * 4] * 2  # own key + ceil(0.5 * 11) past keys
