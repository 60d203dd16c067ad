"""Key norm against received attention: the pairs against loops over a causal, padded toy case, the
correlations against scipy, and the pass over a tiny LM against its recorded attention."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from mmlight.analysis import key_norms as kn
from mmlight.nn.attention import causal_mask
from mmlight.nn.sites import AttentionSite
from mmlight.reweighting import Softmax

SITE = AttentionSite("decoder.layers.1.self_attn", "decoder_self", "decoder", 1, Softmax())


def loop_pairs(q, k, keep, rows):
    """(norm, mean weight from the later counted queries that see the key) by loops, in float64."""
    B, H, T, hs = q.shape
    pairs = []
    for b in range(B):
        for h in range(H):
            w = np.zeros((T, T))
            for i in range(T):
                seen = [j for j in range(T) if keep[b, i, j]]
                e = {j: math.exp(float(q[b, h, i] @ k[b, h, j]) / math.sqrt(hs)) for j in seen}
                for j in seen:
                    w[i, j] = e[j] / sum(e.values())
            for j in range(T):
                later = [i for i in range(j + 1, T) if keep[b, i, j] and rows[b, i]]
                if later:
                    pairs.append((float(k[b, h, j].norm()), sum(w[i, j] for i in later) / len(later)))
    return pairs


def test_pairs_against_loops_and_correlations_against_scipy():
    """Two samples, the second padded after position 6 (its padded queries do not count, its padded keys
    are seen by no counted query): the observer's pairs, in order, are the loops'; Pearson and Spearman
    are scipy's on them."""
    g = torch.Generator().manual_seed(0)
    B, H, T = 2, 2, 9
    q = torch.randn(B, H, T, 4, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, T, 4, generator=g, dtype=torch.float64) * torch.rand(1, 1, T, 1, generator=g) * 2
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, 7:] = False
    keep = causal_mask(T, T)[None] & real[:, None, :]  # (B, T, T)
    observer = kn.KeyNormAttention()
    observer.query_keep = {"decoder": real}
    assert observer.edit_mask(SITE, q, k, keep[:, None]) is not None
    ((norms, received),) = observer.pairs[SITE.name]
    want = loop_pairs(q, k, keep, real)
    assert len(want) == B * H * (T - 1) - H * 2  # the last key of each, and sample 1's 2 padded keys
    assert torch.allclose(norms, torch.tensor([p[0] for p in want], dtype=torch.float64))
    assert torch.allclose(received, torch.tensor([p[1] for p in want], dtype=torch.float64))
    got = kn.correlations(norms, received)
    x, y = np.array([p[0] for p in want]), np.array([p[1] for p in want])
    assert got["pairs"] == len(want)
    assert got["pearson"] == pytest.approx(stats.pearsonr(x, y).statistic, abs=1e-12)
    assert got["spearman"] == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)


def test_used_directly_every_query_counts_and_the_sites_own_backend_weighs():
    """Without ``teacher_forced_pass`` to set the task's ``query_keep``, every query row counts: the pairs
    are the loops' with all rows counted. The weights come from the site's reweighting called with the
    backend that reweighting was built with."""

    class Spy(Softmax):
        def compute(self, scores, mask, backend):
            self.backends.append(backend)
            return super().compute(scores, mask, backend)

    spy = Spy(backend="reference")
    spy.backends = []
    site = AttentionSite("decoder.layers.0.self_attn", "decoder_self", "decoder", 0, spy)
    g = torch.Generator().manual_seed(2)
    B, H, T = 2, 2, 6
    q = torch.randn(B, H, T, 4, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, T, 4, generator=g, dtype=torch.float64)
    keep = causal_mask(T, T)[None].expand(B, T, T)
    observer = kn.KeyNormAttention()
    observer.edit_mask(site, q, k, keep[:, None])
    ((norms, received),) = observer.pairs[site.name]
    want = loop_pairs(q, k, keep, torch.ones(B, T, dtype=torch.bool))
    assert len(want) == B * H * (T - 1)
    assert torch.allclose(norms, torch.tensor([p[0] for p in want], dtype=torch.float64))
    assert torch.allclose(received, torch.tensor([p[1] for p in want], dtype=torch.float64))
    assert spy.backends == ["reference"]


def test_ranks_average_ties_as_scipy_and_constant_inputs_have_no_correlation():
    x = torch.tensor([3.0, 1.0, 3.0, 2.0, 1.0, 3.0, 0.5])
    assert torch.equal(kn.average_ranks(x), torch.tensor(stats.rankdata(x.numpy()), dtype=torch.float64))
    y = torch.tensor([1.0, 2.0, 2.0, 5.0, 0.0, 2.0, 1.0])
    assert kn.correlations(x, y)["spearman"] == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert math.isnan(kn.correlations(torch.ones(4), torch.arange(4.0))["pearson"])
    assert math.isnan(kn.pearson(torch.ones(1), torch.ones(1)))


def test_pass_over_a_tiny_lm_matches_its_recorded_attention():
    """key_norm_attention on a 2-layer LM: per layer, the pairs from the weights and keys recorded in the
    same forward pass (every position real, so every key but the last has later queries)."""
    from mmlight.nn.attention import record_attention
    from mmlight.tasks import LanguageModel
    from tests.helpers.models import tiny_transformer

    torch.manual_seed(3)
    task = LanguageModel(tiny_transformer(dropout=0.0)).eval()
    batch = {"input": torch.randint(2, 20, (3, 7))}
    batch["target"] = batch["input"]
    got = kn.key_norm_attention(task, [batch])
    keys = {}
    for layer in task.model.decoder.layers:
        attn = layer.self_attn
        attn.k_proj.register_forward_hook(lambda m, a, out, attn=attn: keys.setdefault(attn, out))
    with torch.no_grad(), record_attention(task) as recorder:
        task.teacher_forced(batch)
    assert list(got) == ["decoder.layers.0.self_attn", "decoder.layers.1.self_attn"]
    for n, (name, entry) in enumerate(got.items()):
        w = recorder[name][0].weights.double()  # (3, nh, 7, 7)
        k = keys[task.model.decoder.layers[n].self_attn].double().view(3, 7, 2, 8).transpose(1, 2)
        later = torch.tril(torch.ones(7, 7, dtype=torch.bool), diagonal=-1)  # query i > key j
        mean = (w * later).sum(2)[..., :-1] / later.sum(0)[:-1]  # (3, nh, 6)
        assert entry["pairs"] == 3 * 2 * 6
        assert torch.allclose(torch.tensor(entry["received"], dtype=torch.float64), mean.flatten(), atol=1e-6)
        assert torch.allclose(
            torch.tensor(entry["norm"], dtype=torch.float64), k[..., :-1, :].norm(dim=-1).flatten(), atol=1e-5
        )
        assert entry["spearman"] == pytest.approx(stats.spearmanr(entry["norm"], entry["received"]).statistic)


def test_grouped_keys_through_a_cache_give_the_pairs_of_the_repeated_heads():
    """Grouped-query keys (2 KV heads for 4 query heads) and 3 queries at the end of 8 keys (decoding
    through a cache), with the task's full-length query_keep: the pairs equal the loops' on the keys
    repeated by hand to each query head, and on the last 3 rows of the counted queries."""
    g = torch.Generator().manual_seed(1)
    B, H, T, Tq = 2, 4, 8, 3
    q = torch.randn(B, H, Tq, 4, generator=g, dtype=torch.float64)
    k = torch.randn(B, 2, T, 4, generator=g, dtype=torch.float64)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, 6] = False  # query 6 of sample 1 does not count
    keep = causal_mask(Tq, T)[None].expand(B, Tq, T)
    observer = kn.KeyNormAttention()
    observer.query_keep = {"decoder": real}
    observer.edit_mask(SITE, q, k, keep[:, None])
    ((norms, received),) = observer.pairs[SITE.name]
    repeated = k[:, [0, 0, 1, 1]]  # query head h reads KV head h // 2
    full_q = torch.cat([torch.zeros(B, H, T - Tq, 4, dtype=torch.float64), q], 2)  # rows 0..4 never count
    full_keep = torch.cat([torch.zeros(B, T - Tq, T, dtype=torch.bool), keep], 1)
    want = loop_pairs(full_q, repeated, full_keep, real & (torch.arange(T) >= T - Tq))
    assert len(want) == B * H * (T - 1)  # every key but the last is seen by query 7 (query 6 of sample 1 not counted)
    assert torch.allclose(norms, torch.tensor([p[0] for p in want], dtype=torch.float64))
    assert torch.allclose(received, torch.tensor([p[1] for p in want], dtype=torch.float64))


def test_received_attention_stays_on_the_weights_device():
    """On the meta device (standing in for an accelerator) the positions compared are made there too."""
    weights = torch.rand(2, 3, 4, 6, device="meta")
    keys = torch.ones(2, 1, 4, 6, dtype=torch.bool, device="meta")
    mean, seen = kn.received_attention(weights, keys, torch.ones(2, 4, dtype=torch.bool, device="meta"))
    assert (mean.device.type, seen.device.type, mean.shape, seen.shape) == ("meta", "meta", (2, 3, 6), (2, 3, 6))


def test_pearson_of_two_points_and_of_small_values_as_scipy():
    """Two points are perfectly (anti-)correlated; values of order 1e-4 (a denominator far below 1)
    give scipy's r, not NaN."""
    assert kn.pearson(torch.tensor([1.0, 2.0]), torch.tensor([5.0, 3.0])) == pytest.approx(-1.0, abs=1e-12)
    x = torch.tensor([1.0, 3.0, 2.0, 5.0], dtype=torch.float64) * 1e-4
    y = torch.tensor([2.0, 1.0, 4.0, 3.0], dtype=torch.float64) * 1e-4
    assert kn.pearson(x, y) == pytest.approx(stats.pearsonr(x.numpy(), y.numpy()).statistic, abs=1e-12)
