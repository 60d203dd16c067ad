"""Every attention statistic against an independent computation on constructed inputs."""

import itertools
import math

import numpy as np
import pytest
import torch

from mmlight.analysis import metrics as M


def test_uniform_attention_has_entropy_log_k_and_normalised_entropy_1():
    K = 7
    w = torch.full((2, 3, 5, K), 1.0 / K)
    keys = M.attended(w, None)
    assert torch.allclose(M.entropy(w), torch.full((2, 3, 5), math.log(K), dtype=torch.float64))
    assert torch.allclose(M.normalized_entropy(w, keys), torch.ones(2, 3, 5, dtype=torch.float64))


def test_entropy_over_attended_keys_only_and_one_key_rows_are_undefined():
    # causal 4x4: row i attends i+1 keys uniformly -> entropy log(i+1); row 0 has one key
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    w = keep.double() / keep.sum(-1, keepdim=True)
    w = w[None, None]  # (1, 1, 4, 4)
    keys = M.attended(w, keep)
    expected = torch.tensor([math.log(n) for n in (1, 2, 3, 4)], dtype=torch.float64)
    assert torch.allclose(M.entropy(w)[0, 0], expected)
    ne = M.normalized_entropy(w, keys)[0, 0]
    assert math.isnan(ne[0]) and torch.allclose(ne[1:], torch.ones(3, dtype=torch.float64))


def test_entropy_of_random_rows_equals_scipy():
    from scipy.stats import entropy as scipy_entropy

    w = torch.softmax(torch.randn(3, 11, dtype=torch.float64), -1)
    assert np.allclose(M.entropy(w).numpy(), scipy_entropy(w.numpy(), axis=-1))


def naive_m_and_s(x, p, keep, eps_m, eps_s):
    """M and S of one row by a plain loop over the attended keys (no masking tricks)."""
    xs = [float(v) for v, k in zip(x, keep) if k]
    ps = [float(v) for v, k in zip(p, keep) if k]
    mean = sum(xs) / len(xs)
    c = [v - mean for v in xs]
    i_max = max(range(len(c)), key=c.__getitem__)
    relevant = [j for j in range(len(c)) if eps_m < c[j] < c[i_max]]
    m = 1 - sum(ps[i_max] - ps[j] for j in relevant) / len(relevant) if relevant else math.nan
    soft = np.exp(np.array(c) - max(c))
    s_ref = float((soft / soft.sum()).min())
    small = [j for j in range(len(c)) if c[j] < eps_s]
    s = sum(math.exp((s_ref - ps[j]) / s_ref - 1) for j in small) / len(small) if small else math.nan
    return m, s


@pytest.mark.parametrize("eps_m, eps_s", [(0.0, 0.0), (0.5, -0.3)])
def test_multimodality_and_sparsity_against_a_loop_with_masked_keys(eps_m, eps_s):
    torch.manual_seed(1)
    x = torch.randn(2, 2, 3, 9, dtype=torch.float64) * 2
    keep = torch.rand(2, 1, 1, 9) > 0.3
    keep[..., 0] = True
    p = torch.where(keep, torch.softmax(torch.where(keep, x, -math.inf), -1), 0.0)
    keys = M.attended(p, keep)
    m = M.multimodality(x, p, keys, eps_m)
    s = M.sparsity(x, p, keys, eps_s)
    for b, h, q in itertools.product(range(2), range(2), range(3)):
        em, es = naive_m_and_s(x[b, h, q], p[b, h, q], keep[b, 0, 0], eps_m, eps_s)
        for got, want in ((m[b, h, q], em), (s[b, h, q], es)):
            assert (math.isnan(want) and math.isnan(got)) or got == pytest.approx(want, rel=1e-9)


def test_sparsity_is_1_for_exact_zeros_and_multimodality_1_for_equal_peaks():
    x = torch.tensor([[3.0, 3.0 - 1e-6, -5.0, -6.0]], dtype=torch.float64)
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)  # a sparse, bimodal output
    keys = torch.ones_like(p, dtype=torch.bool)
    assert M.sparsity(x, p, keys).item() == pytest.approx(1.0)
    assert M.multimodality(x, p, keys).item() == pytest.approx(1.0)


def test_histogram_and_cdf_against_numpy():
    values = torch.tensor([0.0, 1e-9, 1e-8, 5e-4, 1e-3, 0.2, 0.9999, 1.0], dtype=torch.float64)
    counts = M.weight_histogram(values)
    edges = M.HIST_EDGES.numpy()
    assert counts[0] == 2  # 0 and 1e-9 fall below 1e-8
    binned, _ = np.histogram(values.numpy()[values.numpy() >= 1e-8], bins=edges)  # last bin closed at 1
    assert counts[1:].tolist() == binned.tolist()
    cdf = M.cdf_from_histogram(counts)
    for i in (5, 20, 31):
        assert cdf[i].item() == pytest.approx(np.mean(values.numpy() < edges[i]))
    assert cdf[-1] == 1.0


def test_one_hot_permutations_roll_out_to_their_product():
    torch.manual_seed(0)
    T, eye = 5, torch.eye(5, dtype=torch.float64)
    perms = [eye[torch.randperm(T)] for _ in range(3)]
    rolled = M.rollout([p[None] for p in perms])
    expected = eye
    for layer, p in enumerate(perms):  # Â = 0.5 (P + I), whose rows already sum to 1
        expected = (0.5 * (p + eye)) @ expected
        assert torch.allclose(rolled[layer][0], expected)
    # Without the residual identity, one-hot rows multiply to the permutation product
    # (checked through the definition: rollout of A with A = 2P - I gives Â = P).
    rolled_pure = M.rollout([(2 * p - eye)[None] for p in perms])
    assert torch.allclose(rolled_pure[-1][0], perms[2] @ perms[1] @ perms[0])


def test_rollout_discrepancy_is_total_variation_over_counted_rows():
    r = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]], dtype=torch.float64)
    a = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]], dtype=torch.float64)
    total, n = M.rollout_discrepancy(r, a, torch.tensor([[True, True]]))
    assert (total, n) == (1.0, 2)
    total, n = M.rollout_discrepancy(r, a, torch.tensor([[False, True]]))
    assert (total, n) == (0.0, 1)


def test_identical_tokens_have_similarity_1_and_padding_is_excluded():
    x = torch.randn(1, 1, 8).expand(2, 6, 8).clone()
    assert torch.allclose(M.token_similarity(x), torch.ones(2, dtype=torch.float64))
    x[1, 4:] = -x[1, 4:]  # padding tokens pointing the other way
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    assert torch.allclose(M.token_similarity(x, valid), torch.ones(2, dtype=torch.float64))
    assert M.token_similarity(x)[1] < 0.5


def test_token_similarity_against_explicit_pairs():
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    sim = M.token_similarity(x, valid)
    for b in range(2):
        idx = valid[b].nonzero().flatten().tolist()
        pairs = [torch.cosine_similarity(x[b, i], x[b, j], dim=0) for i in idx for j in idx if i != j]
        assert sim[b].item() == pytest.approx(float(sum(pairs) / len(pairs)))
    assert math.isnan(sim[2])  # one token: no pair


def test_a_hand_built_sink_is_found():
    T = 10
    keep = torch.ones(T, T, dtype=torch.bool).tril()  # causal
    w = keep.double() * 0.01
    w[:, 3] = torch.where(keep[:, 3], 1.0, 0.0)  # every query that sees key 3 puts most weight there
    w = w / w.sum(-1, keepdim=True)
    w = w[None, None].expand(2, 4, T, T)
    keys = M.attended(w, keep)
    raw, relative, seen = M.incoming_attention(w, keys, M.counted_rows(keys))
    mean_relative = relative.sum(0) / seen.sum(0)
    assert mean_relative.argmax().item() == 3
    assert M.sink_ratio(mean_relative, eps=3.0) == pytest.approx(1 / T)
    # raw incoming attention = mean over the (head, query) pairs that can see the key
    assert torch.allclose(raw.sum(0) / seen.sum(0), (w[0, 0] * keep).sum(0) / keep.sum(0))


def test_uniform_attention_has_relative_incoming_1_everywhere():
    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    w = (keep.double() / keep.sum(-1, keepdim=True))[None, None]
    keys = M.attended(w, keep)
    _, relative, seen = M.incoming_attention(w, keys, M.counted_rows(keys))
    assert torch.allclose(relative / seen, torch.ones(1, 6, dtype=torch.float64))
    assert M.sink_ratio((relative / seen)[0], eps=3.0) == 0.0


def test_fully_masked_rows_and_padding_queries_never_count():
    keep = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])  # row 1: no key
    w = torch.where(keep, torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), 0.0)[None, None]
    keys = M.attended(w, keep)
    rows = M.counted_rows(keys, query_keep=torch.tensor([[True, True, False]]))  # query 2 is padding
    assert rows[0, 0].tolist() == [True, False, False]
    raw, relative, seen = M.incoming_attention(w, keys, rows)
    assert seen[0].tolist() == [1.0, 1.0, 0.0] and raw[0].tolist() == [0.5, 0.5, 0.0]
