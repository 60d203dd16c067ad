"""KV eviction: the kept keys of l2 and streaming against brute force, each scoring function against a
brute-force or float64 computation, the attention loss of every method against loops and the oracle's
against exhaustive search, incremental decoding against teacher forcing (kvpress: test_kv_eviction_kvpress.py)."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from mmlight.analysis import kv_eviction as kv
from mmlight.nn.attention import causal_mask
from mmlight.nn.sites import AttentionSite
from mmlight.reweighting import Softmax
from tests.helpers.models import tiny_transformer


def site(layer=0, kind="decoder_self", module=None):
    """The site of a decoder layer's self- or cross-attention (a softmax by default)."""
    name = f"decoder.layers.{layer}.{'cross_attn' if kind == 'cross' else 'self_attn'}"
    key_stack = "encoder" if kind == "cross" else None
    return AttentionSite(name, kind, "decoder", layer, module or Softmax(), key_stack=key_stack)


SITE = site(3)


def test_every_method_is_registered_and_unknown_names_are_refused():
    assert list(kv.METHODS) == ["l2", "streaming", "oracle", "random", "qfilters", "expected_attention"]
    with pytest.raises(
        ValueError, match=r"^qfilters needs calibrated filters: run `mmlight analyze --kv_calibrate N` first$"
    ):
        kv.method("qfilters")


def test_a_calls_full_attention_is_computed_once_with_the_layers_own_backend():
    """``KVCall.weights``: the layer's reweighting over the unevicted keys, on the layer's backend (here
    ``compile``, which the spy records and replaces by the reference), with the KV heads repeated to the
    query heads, scaled by 1/sqrt(hs), computed once per call."""
    seen = []

    class Spy(Softmax):
        def compute(self, scores, mask, backend):
            seen.append(backend)
            return super().compute(scores, mask, "reference")

    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)  # 4 query heads over 2 KV heads
    keys = causal_mask(3, 3).expand(1, 4, 3, 3)
    call = kv.KVCall(site(module=Spy(backend="compile")), q, k, keys, keys)
    got = call.weights()
    assert seen == ["compile"] and call.weights() is got and seen == ["compile"]
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) / math.sqrt(8)
    torch.testing.assert_close(got, scores.masked_fill(~keys, -math.inf).softmax(-1))


def brute_force_l2(k, keep, ratio):
    """Each query's kept keys by a loop: itself, and the ceil(r n) lowest-norm of its n past keys."""
    B, H, T, _ = k.shape
    out = torch.zeros(B, H, T, T, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for q in range(T):
                past = [j for j in range(T) if keep[b, q, j] and j != q]
                n_keep = math.ceil(round(ratio * len(past), 9))
                kept = sorted(past, key=lambda j: (float(k[b, h, j].norm()), j))[:n_keep]
                for j in kept + ([q] if keep[b, q, q] else []):
                    out[b, h, q, j] = True
    return out


def brute_force_streaming(keep, ratio, heads):
    B, T, _ = keep.shape
    out = torch.zeros(B, heads, T, T, dtype=torch.bool)
    for b in range(B):
        for q in range(T):
            past = [j for j in range(T) if keep[b, q, j] and j != q]
            n_keep = math.ceil(round(ratio * len(past), 9))
            start = past[: min(4, n_keep)]
            recent = past[len(past) - (n_keep - len(start)) :] if n_keep > len(start) else []
            for j in set(start + recent + ([q] if keep[b, q, q] else [])):
                out[b, :, q, j] = True
    return out


@pytest.mark.parametrize("ratio", [1.0, 0.9, 0.7, 0.5, 0.3, 0.1])
def test_l2_and_streaming_eviction_against_brute_force(ratio):
    torch.manual_seed(0)
    B, H, T = 2, 2, 12
    q, k = torch.randn(B, H, T, 4), torch.randn(B, H, T, 4)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, 9:] = False
    keep = causal_mask(T, T)[None] & real[:, None, :]  # (B, T, T)
    mask = keep[:, None]  # (B, 1, T, T) as attention passes it
    got = kv.KVEviction(ratio, "l2", skip_layers=2).edit_mask(SITE, q, k, mask)
    assert torch.equal(got, brute_force_l2(k, keep, ratio))
    got = kv.KVEviction(ratio, "streaming", skip_layers=2).edit_mask(SITE, q, k, mask)
    assert torch.equal(got, brute_force_streaming(keep, ratio, H))
    if ratio == 1.0:
        assert torch.equal(got, mask.expand(B, H, T, T))


def test_eviction_skips_the_first_layers_and_other_kinds():
    q = k = torch.randn(1, 1, 5, 4)
    mask = causal_mask(5, 5)
    evict = kv.KVEviction(0.1, "l2", skip_layers=2)
    assert evict.edit_mask(site(1), q, k, mask) is mask
    assert evict.edit_mask(site(0, "cross"), q, k, mask) is mask
    assert evict.edit_mask(site(2), q, k, mask).sum() < mask.sum()


def test_bad_eviction_arguments():
    with pytest.raises(ValueError, match="keep ratio"):
        kv.KVEviction(0.0)
    with pytest.raises(ValueError, match="unknown KV eviction method 'lru'; known: l2, streaming"):
        kv.KVEviction(0.5, "lru")


def test_eviction_of_a_decoding_step_with_a_cache():
    """Two queries at positions 4 and 5 of 6 keys (bottom-right causal): query 4 has past keys 0..3 and
    keeps ceil(0.5 * 4) = 2, query 5 has 0..4 and keeps 3; by hand, with key norms 5, 1, 4, 2, 3, 0.5."""
    norms = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0, 0.5])
    k = torch.zeros(1, 1, 6, 4)
    k[0, 0, :, 0] = norms
    q = torch.randn(1, 1, 2, 4)
    mask = causal_mask(2, 6)
    l2 = kv.KVEviction(0.5, "l2", skip_layers=0).edit_mask(SITE, q, k, mask)
    assert l2[0, 0].nonzero().tolist() == [[0, 1], [0, 3], [0, 4], [1, 1], [1, 3], [1, 4], [1, 5]]
    streaming = kv.KVEviction(0.5, "streaming", skip_layers=0).edit_mask(SITE, q, k, mask)
    assert streaming[0, 0].nonzero().tolist() == [[0, 0], [0, 1], [0, 4], [1, 0], [1, 1], [1, 2], [1, 5]]


def test_streaming_keeps_the_first_4_and_the_most_recent():
    """One query with 10 past keys at r = 0.7: 7 kept, the first 4 (attention sinks) and the 3 newest."""
    q, k = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 11, 4)
    got = kv.KVEviction(0.7, "streaming", skip_layers=0).edit_mask(SITE, q, k, None)
    assert got[0, 0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 7, 8, 9, 10]


def test_eviction_defaults_and_the_ratio_bounds():
    """Defaults: l2 from layer 2 on (docs/analysis.md); ratio 1 is allowed, anything above is not."""
    evict = kv.KVEviction(0.5)
    assert (evict.method.name, evict.skip_layers) == ("l2", 2)
    assert kv.KVEviction(1.0).ratio == 1.0
    with pytest.raises(ValueError, match=r"keep ratio must be in \(0, 1\], got 1.5"):
        kv.KVEviction(1.5)
    with pytest.raises(ValueError, match=r"unknown KV eviction method 'lfu'"):
        kv.KVEviction(0.5, "lfu")


def test_budget_rounds_up():
    """ceil(r n): 0.5 * 3 = 1.5 -> 2, 0.3 * 10 = 3 (exactly, despite float noise) -> 3, 0.31 * 10 -> 4,
    0.7 * 10 -> 7 and 0.1 * 10 -> 1 (no float noise), 0.1 * 0 -> 0."""
    assert kv.budget(torch.tensor([3, 10, 10, 0]), 0.5).tolist() == [2, 5, 5, 0]
    assert kv.budget(torch.tensor([10]), 0.3).item() == 3 and kv.budget(torch.tensor([10]), 0.31).item() == 4
    assert kv.budget(torch.tensor([10]), 0.9).item() == 9 and kv.budget(torch.tensor([1]), 0.1).item() == 1
    assert kv.budget(torch.tensor([10]), 0.7).item() == 7 and kv.budget(torch.tensor([10]), 0.1).item() == 1


def test_compression_ratio_is_the_dropped_fraction_to_12_decimals():
    """1 - r without float noise for the study's keep ratios, and rounded at the 12th decimal: a ratio
    given to 13 decimals loses its last one."""
    assert [kv.compression_ratio(r) for r in kv.KEEP_RATIOS] == [0.0, 0.1, 0.3, 0.5, 0.7, 0.9]
    assert kv.compression_ratio(0.1234567890123) == 0.876543210988


def test_full_mask_expands_or_fills():
    q, k = torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 5, 8)
    assert kv.full_mask(q, k, None).shape == (2, 3, 4, 5) and kv.full_mask(q, k, None).all()
    mask = causal_mask(4, 5)
    assert torch.equal(kv.full_mask(q, k, mask), mask.expand(2, 3, 4, 5))


def test_l2_eviction_breaks_norm_ties_by_keeping_the_older_key():
    """40 keys of equal norm (long enough for an unstable sort to reorder them): the query at position 39
    keeps ceil(0.5 * 39) = 20 past keys, the first 20, as brute_force_l2's (norm, position) order says."""
    q, k = torch.randn(1, 1, 1, 4), torch.ones(1, 1, 40, 4)
    got = kv.KVEviction(0.5, "l2", skip_layers=0).edit_mask(SITE, q, k, None)
    assert got[0, 0, 0].nonzero().flatten().tolist() == list(range(20)) + [39]


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
            losses[name] = evict.loss[0].method / evict.loss[0].rows
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


def test_rotary_average_keeps_float64_precision_far_into_the_sequence():
    """At position 100 000 with Llama's base, an angle in float32 frequencies would be off by about
    1e-4 rad: the average matches the float64 rotations to 1e-10."""
    want = torch.stack([rope_matrix(100_000 + 1 + t, 8, 10_000.0) for t in range(4)]).mean(0)
    torch.testing.assert_close(kv.rotary_average(100_000, 4, 8, 10_000.0), want, rtol=0, atol=1e-10)
    got = kv.rotary_average(torch.tensor([7, 100_000]), 4, 8, 10_000.0)
    torch.testing.assert_close(got[1], want, rtol=0, atol=1e-10)


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
    """Records each evicted decoder call: the mask it returned (:attr:`masks`) and ``(layer, q, k, the
    mask it saw, the mask it returned)`` (:attr:`calls`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.masks, self.calls = [], []

    def edit_mask(self, site, q, k, mask):
        out = super().edit_mask(site, q, k, mask)
        if site.kind == "decoder_self" and site.layer >= self.skip_layers:
            self.masks.append(out)
            self.calls.append((site.layer, q.double(), k.double(), kv.full_mask(q, k, mask), out))
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


def brute_force_losses(calls, ratio, sink):
    """Per layer ``[method, oracle, rows]`` sums by loops: each row's weights from the scores
    (``exp(s) / (sink + sum exp(s))``), the share of the row's mass on its past keys that the returned
    mask dropped, and the least share any ``ceil(r n)`` of its ``n`` past keys can leave out."""
    sums = {}
    for layer, q, k, keys, kept in calls:
        B, H, Tq, hs = q.shape
        Tk = k.shape[2]
        q, k, keys, kept = q.tolist(), k.tolist(), keys.tolist(), kept.tolist()  # plain Python from here
        acc = sums.setdefault(layer, [0.0, 0.0, 0])
        for b, h, i in itertools.product(range(B), range(H), range(Tq)):
            seen = [j for j in range(Tk) if keys[b][h][i][j]]
            dot = {j: sum(x * y for x, y in zip(q[b][h][i], k[b][h][j])) for j in seen}
            e = {j: math.exp(dot[j] / math.sqrt(hs)) for j in seen}
            w = {j: v / (sink + sum(e.values())) for j, v in e.items()}
            total = sum(w.values())
            past = [j for j in seen if j != Tk - Tq + i]
            n_keep = math.ceil(round(ratio * len(past), 9))
            dropped = sum(w[j] for j in past if not kept[b][h][i][j])
            least = sum(sorted(w[j] for j in past)[: len(past) - n_keep])
            acc[0], acc[1], acc[2] = acc[0] + dropped / total, acc[1] + least / total, acc[2] + 1
    return sums


@pytest.mark.parametrize("function", ["softmax", "softmax1"])
def test_attention_loss_of_every_method_against_brute_force_and_never_below_the_oracle(function):
    """A 2-layer LM on 3 sequences, every layer evicted at r = 0.5 and 0.3 by each method: each layer's
    loss (and the pooled one) is the loops' recomputation from the recorded calls, softmax1's rows (mass
    below 1) normalised by their own mass; no method loses less than the oracle at its budget, and the
    oracle method loses exactly that."""
    from mmlight.models.transformer import TransformerLM
    from mmlight.nn.attention import observe_attention
    from tests.helpers.models import tiny

    torch.manual_seed(7)
    net = TransformerLM(tiny(name=function, dropout=0.0)).eval()
    tokens = torch.randint(2, 23, (3, 10))
    filters = torch.randn(2, 2, 16)
    for ratio in (0.5, 0.3):
        for name in kv.METHODS:
            options = (
                {"filters": filters} if name == "qfilters" else {"n_sink": 2} if name == "expected_attention" else {}
            )
            evict = Recording(ratio, kv.method(name, **options), skip_layers=0, measure_loss=True)
            with torch.no_grad(), observe_attention(net, evict):
                net(tokens)
            want = brute_force_losses(evict.calls, ratio, sink=1.0 if function == "softmax1" else 0.0)
            rows = evict.loss_rows()
            assert [r[0] for r in rows] == [0, 1, "all"]
            for layer, n, loss, oracle in rows[:2]:
                assert n == want[layer][2] == 3 * 2 * 10
                assert loss == pytest.approx(want[layer][0] / n, abs=1e-6), (name, ratio, layer)
                assert oracle == pytest.approx(want[layer][1] / n, abs=1e-6), (name, ratio, layer)
                assert loss >= oracle - 1e-12
                if name == "oracle":
                    assert loss == pytest.approx(oracle, abs=1e-12)
            assert rows[2][1:] == pytest.approx(
                (120, sum(r[2] for r in rows[:2]) / 2, sum(r[3] for r in rows[:2]) / 2), abs=1e-12
            )
            assert rows[2][2] > 0 and (name == "oracle" or rows[2][2] > rows[2][3])


def test_ratio_1_loses_nothing_and_no_call_measures_nothing():
    evict = kv.KVEviction(1.0, "l2", skip_layers=0, measure_loss=True)
    assert evict.loss_rows() == []
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    evict.edit_mask(site(), q, k, causal_mask(5, 5))
    assert evict.loss_rows() == [(0, 10, 0.0, 0.0), ("all", 10, 0.0, 0.0)]


def test_a_layer_without_a_counted_row_has_no_means_and_adds_nothing_to_the_pool():
    """Every query of layer 0's call is padding (fully masked rows weigh nothing, so no row counts): its
    means are None over 0 rows, and the pooled row is layer 1's alone."""
    evict = kv.KVEviction(0.5, "l2", skip_layers=0, measure_loss=True)
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 3, 4, generator=g)
    evict.edit_mask(site(0), q, k, torch.zeros(1, 1, 3, 3, dtype=torch.bool))
    q, k = torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g)
    evict.edit_mask(site(1), q, k, causal_mask(5, 5))
    rows = evict.loss_rows()
    assert rows[0] == (0, 0, None, None)
    layer, n, loss, oracle = rows[1]
    assert (layer, n) == (1, 1 * 2 * 5) and loss > oracle > 0
    assert rows[2] == ("all", n, loss, oracle)


def random_call(B=3, Tk=6, device="cpu"):
    q, k = torch.randn(B, 4, 2, 8, device=device), torch.randn(B, 2, Tk, 8, device=device)
    keys = torch.ones(B, 4, 2, Tk, dtype=torch.bool, device=device)
    return kv.KVCall(SITE, q, k, keys, keys)


def test_random_draws_one_score_per_sample_and_key_from_its_own_seeded_generator():
    """The floor is reproducible from its seed (0 by default) and leaves the global random state alone."""
    call = random_call()
    state = torch.get_rng_state()
    scores = kv.method("random").scores(call)
    assert torch.equal(torch.get_rng_state(), state)
    assert scores.shape == (3, 1, 1, 6) and len({tuple(row.flatten().tolist()) for row in scores}) == 3
    assert torch.equal(kv.Random(seed=0).scores(random_call()), scores)
    assert not torch.equal(kv.Random(seed=1).scores(random_call()), scores)
    assert kv.Random().scores(random_call(device="meta")).device.type == "meta"  # on the keys' device


def test_follow_rows_finds_each_reordered_row_and_leaves_the_global_random_state_alone():
    before = torch.randn(3, 2, 5, 4)
    order = torch.tensor([2, 2, 0, 1])  # beam search may copy a row and drop another
    state = torch.get_rng_state()
    assert kv.follow_rows(before[order], before).tolist() == order.tolist()
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(RuntimeError, match="lost track of the reordered KV cache"):
        kv.follow_rows(before[order] + 1.0, before)


def test_follow_rows_follows_a_single_row_and_matches_relative_to_the_keys_magnitude():
    """One cache row (greedy decoding) is followed; large keys that agree to 1e-9 relative (rounding,
    not another row) still match, as do the same keys at unit scale; a key off by 1e-3 matches nothing,
    refused with the full sentence."""
    g = torch.Generator().manual_seed(8)
    before = torch.randn(3, 2, 5, 4, generator=g, dtype=torch.float64)
    order = torch.tensor([1, 0, 0])
    assert kv.follow_rows(before[[2]], before).tolist() == [2]
    assert kv.follow_rows(before[order] * (1 + 1e-9), before).tolist() == order.tolist()
    assert kv.follow_rows(before[order] * 1e4 * (1 + 1e-9), before * 1e4).tolist() == order.tolist()
    off = before[order].clone()
    off[1, 0, 2, 3] += 1e-3
    sentence = r"^expected_attention lost track of the reordered KV cache \(a row matches no earlier row\)$"
    with pytest.raises(RuntimeError, match=sentence):
        kv.follow_rows(off, before)


def window_statistics(q, start, end):
    """Mean and biased covariance ``(B, h, hs)``, ``(B, h, hs, hs)`` of ``q`` over positions ``start ..
    end`` by a loop over the positions (zero for an empty range)."""
    B, h, _, hs = q.shape
    mu, sigma = torch.zeros(B, h, hs, dtype=torch.float64), torch.zeros(B, h, hs, hs, dtype=torch.float64)
    rows = range(max(start, 0), end + 1)
    if len(rows) == 0:
        return mu, sigma
    for t in rows:
        mu += q[:, :, t].double()
    mu /= len(rows)
    for t in rows:
        c = q[:, :, t].double() - mu
        sigma += c[..., :, None] * c[..., None, :]
    return mu, sigma / len(rows)


def test_running_statistics_from_position_0_one_query_a_chunk():
    """With ``start`` 0 (no sink) and a chunk too small for even one query's covariances, each query is
    its own chunk, and each chunk's statistics include position 0 (against a loop over the window)."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 3, 7, 4, generator=g)
    chunks = list(kv.running_statistics(q, start=0, first=1, chunk_bytes=1))
    assert [c[0].tolist() for c in chunks] == [[e] for e in range(1, 7)]
    for ends, mu, sigma in chunks:
        want_mu, want_sigma = window_statistics(q, 0, int(ends[0]))
        torch.testing.assert_close(mu[:, :, 0], want_mu)
        torch.testing.assert_close(sigma[:, :, 0], want_sigma)


def test_running_statistics_and_the_rotation_stay_on_the_queries_device():
    """On the meta device (standing in for an accelerator), the positions, means and covariances of
    every chunk, and Expected Attention's rotated mean and covariance, are made on the queries' device."""
    q = torch.randn(2, 3, 6, 4, device="meta")
    chunks = list(kv.running_statistics(q, start=2, first=1, chunk_bytes=1))
    assert len(chunks) == 5
    for ends, mu, sigma in chunks:
        assert (ends.device.type, mu.device.type, sigma.device.type) == ("meta", "meta", "meta")
        assert mu.shape == (2, 3, 1, 4) and sigma.shape == (2, 3, 1, 4, 4)
    mu, sigma = torch.zeros(2, 3, 4, 4, device="meta"), torch.zeros(2, 3, 4, 4, 4, device="meta")
    rotated = kv.ExpectedAttention()._rotated(mu.double(), sigma.double(), torch.arange(4), 100.0, 4)
    assert [t.device.type for t in rotated] == ["meta", "meta"]


class ToyAttention(torch.nn.Module):
    """What Expected Attention reads from an attention layer (``q_proj``, ``v_proj``, ``out_proj``, the
    head counts, the positions kind); its forward only lets the method's hook see the layer input."""

    def __init__(self, d, n_heads, n_kv_heads, hs, theta):
        super().__init__()
        self.reweight = Softmax()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.q_proj = torch.nn.Linear(d, n_heads * hs, dtype=torch.float64)
        self.v_proj = torch.nn.Linear(d, n_kv_heads * hs, dtype=torch.float64)
        self.out_proj = torch.nn.Linear(n_heads * hs, d, dtype=torch.float64)
        self.positions = "additive" if theta is None else "rotary"
        self.rope_theta = theta

    def forward(self, x):
        return x


def brute_force_expected_attention(attn, hidden, k, keys, past, n_sink, future, value_norm):
    """Thesis Eq. 4.11 by loops, per KV head ``g`` and query ``i`` (position ``p``): for each query head
    of the group, the Gaussian of its queries over positions ``n_sink .. p`` rotated by the mean rope
    rotation of positions ``p + 1 .. p + future`` (:func:`rope_matrix`), the closed-form expected logit
    of each key, a softmax over the keys the query sees less the first ``n_sink`` past ones (none: 0),
    times the value norm; averaged over the group, the sinks infinite."""
    B, Tk, _ = hidden.shape
    nh, n_kv, hs, Tq = attn.n_heads, attn.n_kv_heads, k.shape[-1], keys.shape[2]
    group = nh // n_kv
    with torch.no_grad():
        queries = attn.q_proj(hidden).view(B, Tk, nh, hs)
        values = attn.v_proj(hidden).view(B, Tk, n_kv, hs)
        w_o = attn.out_proj.weight.detach()
    out = torch.zeros(B, n_kv, Tq, Tk, dtype=torch.float64)
    rotation = {}
    for b, g, i in itertools.product(range(B), range(n_kv), range(Tq)):
        p = Tk - Tq + i
        if attn.rope_theta is None:
            rot = torch.eye(hs, dtype=torch.float64)
        else:
            if p not in rotation:
                rotation[p] = torch.stack([rope_matrix(p + 1 + t, hs, attn.rope_theta) for t in range(future)]).mean(0)
            rot = rotation[p]
        for h in range(g * group, (g + 1) * group):
            sinks = [j for j in range(Tk) if past[b, h, i, j]][:n_sink]
            allowed = [j for j in range(Tk) if keys[b, h, i, j] and j not in sinks]
            x = queries[b, n_sink : p + 1, h]
            mu = x.mean(0) if len(x) else torch.zeros(hs, dtype=torch.float64)
            sigma = (x - mu).T @ (x - mu) / len(x) if len(x) else torch.zeros(hs, hs, dtype=torch.float64)
            mu, sigma = rot @ mu, rot @ sigma @ rot.T
            kg = k[b, g].double()
            logit = {j: float(mu @ kg[j]) / hs**0.5 + float(kg[j] @ sigma @ kg[j]) / (2 * hs) for j in allowed}
            total = sum(math.exp(v) for v in logit.values())
            for j in allowed:
                v = values[b, j, g]
                norm = (w_o[:, h * hs : (h + 1) * hs] @ v).norm() if value_norm == "out" else v.norm()
                out[b, g, i, j] += math.exp(logit[j]) / total * float(norm) / group
        out[b, g, i, sinks] = math.inf
    return out


@pytest.mark.parametrize(
    ("n_kv_heads", "theta", "tq", "options", "chunk_bytes", "keyword"),
    [
        (2, 100.0, 3, {"future": 5, "n_sink": 2}, None, False),  # grouped keys, 3 queries through a cache
        (2, 100.0, 7, {"future": 5, "n_sink": 2}, 1, True),  # teacher-forced, one query a chunk, x=...
        (4, None, 7, {"future": 5, "n_sink": 2, "value_norm": "value"}, 1, False),  # ungrouped, additive
        (1, 100.0, 4, {"future": 5, "n_sink": 2}, 600, False),  # one KV head (multi-query), 2 queries a chunk
        (2, 10_000.0, 7, {}, None, False),  # the defaults: 512 future positions, 4 sinks, ||W_O v||
    ],
)
def test_expected_attention_scores_against_brute_force(
    monkeypatch, n_kv_heads, theta, tq, options, chunk_bytes, keyword
):
    """Expected Attention's scores ``(B, n_kv, Tq, Tk)`` for keys given per KV head (4 query heads),
    equal to :func:`brute_force_expected_attention`, with a padded key and a padded query whose only
    visible keys are sinks (an empty softmax: zero), whatever the chunking of the statistics and
    whether the layer gets its input by position or as ``x=``."""
    if chunk_bytes is not None:
        monkeypatch.setattr(kv, "running_statistics", functools.partial(kv.running_statistics, chunk_bytes=chunk_bytes))
    g = torch.Generator().manual_seed(10)
    B, nh, hs, d, Tk = 2, 4, 4, 8, 7
    torch.manual_seed(10)
    attn = ToyAttention(d, nh, n_kv_heads, hs, theta)
    hidden = torch.randn(B, Tk, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, n_kv_heads, Tk, hs, generator=g, dtype=torch.float64)
    real = torch.ones(B, Tk, dtype=torch.bool)
    real[1, 2] = False  # key 2 of sample 1 is padding; query 2 there sees only 2 past keys, both sinks
    keys = (causal_mask(tq, Tk)[None] & real[:, None, :])[:, None].expand(B, nh, tq, Tk)
    own = torch.arange(Tk) == (Tk - tq + torch.arange(tq))[:, None]
    past = keys & ~own
    method = kv.ExpectedAttention(**options)
    with torch.no_grad(), method.attached(attn):
        attn(x=hidden) if keyword else attn(hidden)
        call = kv.KVCall(site(module=attn.reweight), torch.zeros(B, nh, tq, hs), k, keys, past)
        got = method.scores(call)
    n_sink, future, value_norm = options.get("n_sink", 4), options.get("future", 512), options.get("value_norm", "out")
    want = brute_force_expected_attention(attn, hidden, k, keys, past, n_sink, future, value_norm)
    assert got.shape == (B, n_kv_heads, tq, Tk)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    if tq == Tk:  # the padded query's row: sinks, else zero
        assert ((want[1, :, 2] == 0) | want[1, :, 2].isinf()).all() and want[1, :, 2].isinf().sum() == 2 * n_kv_heads


def test_expected_attention_refuses_an_unknown_value_norm():
    with pytest.raises(ValueError, match=r"^value_norm must be 'out' or 'value', got 'norm'$"):
        kv.ExpectedAttention(value_norm="norm")


def test_a_method_defined_later_is_registered_by_its_name():
    """A subclass with ``name`` set is in METHODS (the class itself) and usable by name: here one that
    keeps the oldest keys, checked against the budget by hand."""

    class Oldest(kv.EvictionMethod):
        name = "test_oldest"

        def scores(self, call):
            return -torch.arange(call.keys.shape[-1], dtype=torch.float64)

    try:
        assert kv.METHODS["test_oldest"] is Oldest
        assert isinstance(kv.method("test_oldest"), Oldest)
        q, k = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 7, 4)
        got = kv.KVEviction(0.5, "test_oldest", skip_layers=0).edit_mask(SITE, q, k, None)
        assert got[0, 0, 0].nonzero().flatten().tolist() == [0, 1, 2, 6]  # ceil(0.5 * 6) = 3 oldest, itself
    finally:
        kv.METHODS.pop("test_oldest", None)


@pytest.mark.parametrize("tq", [6, 2], ids=["teacher-forced", "2-queries"])
@pytest.mark.parametrize("name", ["oracle", "l2", "qfilters"])
def test_grouped_keys_evict_as_the_keys_repeated_to_each_query_head(name, tq):
    """Keys of 2 KV heads for 4 query heads (query head h reads KV head h // 2), teacher-forced or 2
    queries through a cache (as many as KV heads): the kept keys and the attention losses equal those of
    the same keys repeated by hand to the 4 heads."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, tq, 8, generator=g)
    k = torch.randn(2, 2, 6, 8, generator=g)
    filters = torch.randn(2, 2, 8, generator=g)
    mask = causal_mask(tq, 6)
    options = {"filters": filters} if name == "qfilters" else {}

    def run(keys, method):
        evict = kv.KVEviction(0.5, method, skip_layers=0, measure_loss=True)
        return evict.edit_mask(site(1), q, keys, mask), evict.loss_rows()

    got, got_loss = run(k, kv.method(name, **options))
    by_hand = {"filters": filters.repeat_interleave(2, dim=1)} if name == "qfilters" else {}
    want, want_loss = run(k[:, [0, 0, 1, 1]], kv.method(name, **by_hand))
    assert torch.equal(got, want)
    assert [r[:2] for r in got_loss] == [r[:2] for r in want_loss] == [(1, 8 * tq), ("all", 8 * tq)]
    assert [r[2:] for r in got_loss] == [pytest.approx(r[2:], abs=1e-12) for r in want_loss]


def test_masks_and_streaming_scores_are_made_on_the_queries_device():
    """On the meta device (standing in for an accelerator): the full mask of a call without one, and the
    streaming scores, are made on the device of the queries and masks; scores made on the CPU (a method's
    random draws) are moved to the device of the mask they select from."""
    q, k = torch.randn(2, 3, 4, 8, device="meta"), torch.randn(2, 3, 5, 8, device="meta")
    full = kv.full_mask(q, k, None)
    assert (full.device.type, full.dtype, full.shape) == ("meta", torch.bool, (2, 3, 4, 5))
    assert kv.streaming_scores(torch.ones(2, 3, 4, 5, dtype=torch.bool, device="meta")).device.type == "meta"
    kept = kv.keep_top(torch.randn(2, 1, 1, 5), full, 0.5)
    assert (kept.device.type, kept.dtype, kept.shape) == ("meta", torch.bool, (2, 3, 4, 5))


def test_l2_scores_of_half_precision_keys_are_float32_norms():
    """float16 keys: the scores are minus the norms in float32 (a float16 norm would be rounded to
    about 3 digits), against float64."""
    g = torch.Generator().manual_seed(12)
    keys = (torch.randn(1, 2, 5, 16, generator=g) * 30).half()
    got = kv.l2_scores(keys)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), -keys.double().norm(dim=-1), rtol=1e-6, atol=0)


def test_qfilter_sign_rule_holds_for_small_queries():
    """Queries of magnitude about 0.01 spread along a direction (mean projection far below 1), and
    their negatives: each filter is the direction signed so that the mean projection is positive."""
    g = torch.Generator().manual_seed(0)
    direction = torch.tensor([0.3, -0.1, 0.05], dtype=torch.float64)
    t = torch.randn(50, 1, generator=g, dtype=torch.float64) + 0.5
    base = (direction * t + 0.01 * torch.randn(50, 3, generator=g, dtype=torch.float64)) * 0.01
    for sign in (1, -1):
        f = kv.qfilters(sign * base)
        assert 0 < float((sign * base @ f).mean()) < 1
        assert torch.allclose(f, sign * direction / direction.norm(), atol=0.05)


def test_attention_loss_leaves_out_rows_of_zero_mass():
    """Three rows, the second of zero mass (no share to lose): the loss sums the other two's shares of
    dropped mass, by hand, over 2 counted rows."""
    weights = torch.tensor([[[[0.5, 0.3, 0.2], [0.0, 0.0, 0.0], [0.1, 0.1, 0.2]]]], dtype=torch.float64)
    dropped = torch.tensor([[[[True, False, False], [True, True, False], [False, False, True]]]])
    total, rows = kv.attention_loss(weights, dropped)
    assert int(rows) == 2
    assert float(total) == pytest.approx(0.5 + 0.2 / 0.4, abs=1e-12)


def test_attention_parts_of_a_module_without_grouped_heads_or_rotary_positions():
    """A module with only ``n_heads`` (no ``n_kv_heads``, ``rope``, ``positions`` or ``q_norm``): as many
    KV heads as query heads, additive positions (no rotary base), no query norm."""
    module = torch.nn.Module()
    module.n_heads = 4
    module.q_proj, module.v_proj, module.out_proj = (torch.nn.Linear(8, 8) for _ in range(3))
    parts = kv.attention_parts(module)
    assert (parts["n_heads"], parts["n_kv_heads"], parts["theta"], parts["q_norm"]) == (4, 4, None, None)
    assert parts["w_o"] is module.out_proj.weight and parts["q_proj"] is module.q_proj
    module.positions, module.rope_theta = "rotary", 500  # a module that rotates by a named base
    assert kv.attention_parts(module)["theta"] == 500.0
    module.positions = "alibi"
    with pytest.raises(ValueError, match=r"^Module\.positions must be 'additive' or 'rotary', got 'alibi'$"):
        kv.attention_parts(module)


def test_query_collector_keeps_the_counted_queries_of_decoder_self_attention_only():
    """The Q-filter calibration's queries: each decoder self-attention call's ``(B, nh, Tq, hs)`` queries
    become ``(n, nh, hs)`` rows, the padding positions of the call's stack left out; the mask passes
    through unchanged, and other kinds of attention add nothing. Before any batch sets ``query_keep``
    (and for a stack without a mask) every position counts."""
    q = torch.arange(2 * 3 * 4 * 2, dtype=torch.float32).view(2, 3, 4, 2)  # (B, nh, Tq, hs)
    mask = causal_mask(4, 4)
    collector = kv.QueryCollector()
    assert collector.edit_mask(site(1), q, q, mask) is mask
    assert torch.equal(collector.queries[1][0], q.transpose(1, 2).reshape(8, 3, 2))  # every position, in order

    keep = torch.tensor([[True, True, False, False], [True, False, False, False]])  # 2 + 1 real positions
    collector.query_keep = {"decoder": keep, "encoder": None}
    collector.edit_mask(site(1), q, q, mask)
    collector.edit_mask(site(0, "cross"), q, q, mask)
    expected = torch.stack([q[0, :, 0], q[0, :, 1], q[1, :, 0]])  # (3, nh, hs)
    assert torch.equal(collector.queries[1][1], expected)
    assert list(collector.queries) == [1] and len(collector.queries[1]) == 2


def test_split_samples_cuts_inside_a_batch_and_keeps_every_sample_once():
    """Batches of 2, 1 and 4 samples (a dict and a tuple of tensors) cut after 4 samples: the first part
    is the first two batches and one sample of the third, the rest its other three; no empty batch."""
    batches = [{"x": torch.arange(0, 2)}, (torch.arange(2, 3), torch.arange(2, 3) * 10), {"x": torch.arange(3, 7)}]
    first, rest = kv.split_samples(batches, 4)
    assert [b["x"].tolist() if isinstance(b, dict) else [t.tolist() for t in b] for b in first] == [
        [0, 1],
        [[2], [20]],
        [3],
    ]
    assert [b["x"].tolist() for b in rest] == [[4, 5, 6]]
    first, rest = kv.split_samples(batches, 3)  # a cut on a batch boundary
    assert len(first) == 2 and [b["x"].tolist() for b in rest] == [[3, 4, 5, 6]]


def test_qfilter_calibration_against_queries_recorded_per_half():
    """``calibrate_qfilters`` on a grouped-query Llama-style LM (4 query heads over 2 KV heads, rotary
    positions) over batches of 2, 3 and 1 sequences, padded ones among them: the filters are the top
    eigenvector of ``Q^T Q`` (signed to the queries' mean) of the real positions' rotated queries of each
    layer's KV group, pooled over all six sequences; the cosine is that between the filters of sequences
    0-2 and 3-5. The queries are recorded by an observer of the test's own, one sequence at a time."""
    from mmlight.models.transformer import LLAMA_STYLE
    from mmlight.nn.attention import AttentionObserver, observe_attention
    from mmlight.tasks import LanguageModel
    from tests.helpers.models import PAD

    torch.manual_seed(0)
    task = LanguageModel(tiny_transformer(**LLAMA_STYLE, n_heads=4, n_kv_heads=2, d_model=32)).eval()
    tokens = torch.randint(2, 20, (6, 7))
    tokens[1, 5:] = PAD
    tokens[4, 3:] = PAD
    batches = [{"input": tokens[a:b], "target": tokens[a:b]} for a, b in ((0, 2), (2, 5), (5, 6))]

    class Queries(AttentionObserver):
        def __init__(self):
            self.rows = {}

        def edit_mask(self, site, q, k, mask):
            self.rows.setdefault(site.layer, []).append(q[0].transpose(0, 1))  # (Tq, nh, hs), one sequence
            return mask

    def queries(samples):  # layer -> (N, nh, hs) over the real positions of these sequences
        record = Queries()
        with torch.no_grad(), observe_attention(task, record):
            for s in samples:
                task.model(tokens[s : s + 1, : int((tokens[s] != PAD).sum())])
        return {layer: torch.cat(rows) for layer, rows in record.rows.items()}

    def filters(q):  # (L, 2, hs): query heads 0-1 form KV group 0, heads 2-3 group 1
        out = []
        for layer in sorted(q):
            groups = []
            for g in range(2):
                x = q[layer][:, 2 * g : 2 * g + 2].reshape(-1, q[layer].shape[-1]).double()
                f = torch.linalg.eigh(x.T @ x).eigenvectors[:, -1]
                groups.append(f * torch.sign((x @ f).mean()))
            out.append(torch.stack(groups))
        return torch.stack(out)

    got = kv.calibrate_qfilters(task, batches)
    assert got["num_sequences"] == 6
    want = filters(queries(range(6)))
    torch.testing.assert_close(got["filters"], want.float(), rtol=0, atol=1e-5)
    cosine = (filters(queries(range(3))) * filters(queries(range(3, 6)))).sum(-1)  # (L, n_kv)
    assert got["cosine"].shape == (2, 2) and float(cosine.abs().min()) < 0.999  # the halves differ
    torch.testing.assert_close(got["cosine"], cosine, rtol=0, atol=1e-6)


def test_qfilter_calibration_needs_two_sequences():
    from mmlight.tasks import LanguageModel

    task = LanguageModel(tiny_transformer()).eval()
    one = [{"input": torch.randint(2, 20, (1, 6)), "target": torch.randint(2, 20, (1, 6))}]
    message = r"^Q-filter calibration needs at least 2 sequences \(two disjoint halves\), got 1$"
    with pytest.raises(ValueError, match=message):
        kv.calibrate_qfilters(task, one)
    two = [{"input": torch.randint(2, 20, (2, 6)), "target": torch.randint(2, 20, (2, 6))}]
    assert kv.calibrate_qfilters(task, two)["filters"].shape == (2, 2, 8)  # (L, n_kv, hs)
