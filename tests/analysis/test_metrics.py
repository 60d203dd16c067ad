"""Every attention statistic against an independent computation on constructed inputs."""

import itertools
import math

import numpy as np
import pytest
import torch

from mmlight.reweighting import metrics as M
from tests.helpers.references import naive_m_and_s


def test_uniform_attention_has_entropy_log_k_and_normalised_entropy_1():
    K = 7
    w = torch.full((2, 3, 5, K), 1.0 / K)
    keys = M.attended(w, None)
    assert torch.allclose(M.entropy(w.double()), torch.full((2, 3, 5), math.log(K), dtype=torch.float64))
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


def centred_m_and_s(scores, p, keys, eps_m=0.0, eps_s=0.0):
    """M and S as the observer takes them: on the scores centred over the attended keys."""
    centred = M.centred_scores(scores, keys)
    return M.multimodality(centred, p, eps_m, keys), M.sparsity(centred, p, eps_s, keys=keys)


@pytest.mark.parametrize("eps_m, eps_s", [(0.0, 0.0), (0.5, -0.3)])
def test_multimodality_and_sparsity_against_a_loop_with_masked_keys(eps_m, eps_s):
    torch.manual_seed(1)
    x = torch.randn(2, 2, 3, 9, dtype=torch.float64) * 2
    keep = torch.rand(2, 1, 1, 9) > 0.3
    keep[..., 0] = True
    p = torch.where(keep, torch.softmax(torch.where(keep, x, -math.inf), -1), 0.0)
    keys = M.attended(p, keep)
    m, s = centred_m_and_s(x, p, keys, eps_m, eps_s)
    for b, h, q in itertools.product(range(2), range(2), range(3)):
        em, es = naive_m_and_s(x[b, h, q], p[b, h, q], keep[b, 0, 0], eps_m, eps_s)
        for got, want in ((m[b, h, q], em), (s[b, h, q], es)):
            assert (math.isnan(want) and math.isnan(got)) or got == pytest.approx(want, rel=1e-9)


def test_sparsity_is_1_for_exact_zeros_and_multimodality_1_for_equal_peaks():
    x = torch.tensor([[3.0, 3.0 - 1e-6, -5.0, -6.0]], dtype=torch.float64)
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)  # a sparse, bimodal output
    keys = torch.ones_like(p, dtype=torch.bool)
    m, s = centred_m_and_s(x, p, keys)
    assert s.item() == pytest.approx(1.0) and m.item() == pytest.approx(1.0)


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


def test_attended_and_counted_rows_on_a_non_square_call():
    """keep=None attends every key; counted rows need a key and a real query (Tq=2 != Tk=3 != nh=4,
    so a reduction over the wrong dimension cannot pass)."""
    w = torch.zeros(1, 4, 2, 3)
    assert M.attended(w, None).shape == (1, 4, 2, 3) and M.attended(w, None).all()
    keep = torch.tensor([[True, False, False], [False, False, False]])  # query 1 has no key
    keys = M.attended(w, keep)
    assert keys.shape == (1, 4, 2, 3) and keys.sum() == 4
    assert M.counted_rows(keys).tolist() == [[[True, False]] * 4]
    assert M.counted_rows(keys, query_keep=torch.tensor([[False, True]])).tolist() == [[[False, False]] * 4]


def test_normalized_entropy_uses_the_given_nats_and_the_number_of_attended_keys():
    """normalized_entropy = nats / log(n) with n counted over the attended keys, from the caller's nats
    when given (here deliberately not the entropy of the weights, to see which one is used)."""
    w = torch.tensor([[0.5, 0.25, 0.25, 0.0]], dtype=torch.float64)
    keys = torch.tensor([[True, True, True, False]])
    nats = 1.5 * math.log(2)  # entropy of (1/2, 1/4, 1/4) by hand
    assert M.normalized_entropy(w, keys).item() == pytest.approx(nats / math.log(3), rel=1e-12)
    assert M.normalized_entropy(w, keys, torch.tensor([2.0], dtype=torch.float64)).item() == pytest.approx(
        2.0 / math.log(3), rel=1e-12
    )


def test_centred_scores_by_hand_including_a_one_key_row():
    """Row mean over attended keys only: (1 + 2 + 6) / 3 = 3; a one-key row is centred to 0 there, so it
    has neither a relevant key (M) nor a small one (S)."""
    scores = torch.tensor([[1.0, 2.0, 6.0, 100.0], [-4.0, 7.0, 7.0, 7.0]])
    keys = torch.tensor([[True, True, True, False], [True, False, False, False]])
    centred = M.centred_scores(scores, keys)
    assert centred.dtype == torch.float64
    assert centred.tolist() == [[-2.0, -1.0, 3.0, 97.0], [0.0, 11.0, 11.0, 11.0]]
    p = torch.tensor([[0.2, 0.3, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    m, s = centred_m_and_s(scores, p, keys)
    # row 0: relevant keys: none strictly between 0 and the max (3) -> M undefined; small: keys 0 and 1,
    # s = softmax(-2, -1, 3)_min
    soft_min = math.exp(-2) / (math.exp(-2) + math.exp(-1) + math.exp(3))
    want_s = (math.exp((soft_min - 0.2) / soft_min - 1) + math.exp((soft_min - 0.3) / soft_min - 1)) / 2
    assert math.isnan(m[0]) and s[0].item() == pytest.approx(want_s, rel=1e-12, abs=0)
    assert math.isnan(m[1]) and math.isnan(s[1])


def test_multimodality_and_sparsity_default_thresholds_are_zero():
    """With the default eps (0 on the centred scores) a key at centred score 0.5 is relevant and one
    at -0.5 is small; eps = 1 (or -1) would exclude them. Hand values: M = 1 - (0.6 - 0.3), S by Def. 3.3."""
    scores = torch.tensor([[2.0, 0.5, -0.5, -2.0]], dtype=torch.float64)  # mean 0
    p = torch.tensor([[0.6, 0.3, 0.1, 0.0]], dtype=torch.float64)
    keys = torch.ones(1, 4, dtype=torch.bool)
    m, s = centred_m_and_s(scores, p, keys)
    assert m.item() == pytest.approx(1 - 0.3, rel=1e-12)
    soft = np.exp([2.0, 0.5, -0.5, -2.0])
    s_ref = soft.min() / soft.sum()
    want = (math.exp((s_ref - 0.1) / s_ref - 1) + math.exp(1 - 1)) / 2
    assert s.item() == pytest.approx(want, rel=1e-12)
    centred = M.centred_scores(scores, keys)  # the functions' own defaults give the same
    assert M.multimodality(centred, p, keys=keys).item() == m.item()
    assert M.sparsity(centred, p, keys=keys).item() == s.item()


def test_sparsity_reference_is_the_smallest_softmax_probability_even_when_tiny():
    """s = softmax(attended centred scores)_min, here about e^-60 / (1 + e^-60) (far below float32's
    range but fine in float64): a weight of s gives the term exp(-1), a weight of 0 gives 1."""
    scores = torch.tensor([[30.0, -30.0, 5.0]], dtype=torch.float64)
    keys = torch.tensor([[True, True, False]])
    s_ref = math.exp(-60) / (1 + math.exp(-60))
    p = torch.tensor([[1.0 - s_ref, s_ref, 0.0]], dtype=torch.float64)
    assert centred_m_and_s(scores, p, keys)[1].item() == pytest.approx(math.exp(-1), rel=1e-9)
    p0 = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    assert centred_m_and_s(scores, p0, keys)[1].item() == pytest.approx(1.0, rel=1e-12)


def test_row_max_is_over_the_keys():
    w = torch.tensor([[[[0.1, 0.9], [0.6, 0.4], [0.5, 0.5]]]])  # (1, 1, 3, 2): the max per query row
    assert M.row_max(w).tolist() == [[[pytest.approx(0.9), pytest.approx(0.6), pytest.approx(0.5)]]]


def test_histogram_bins_at_the_edges_and_a_one_value_cdf():
    """Every edge value goes to the bin it opens ([e_i, e_(i+1))), 1.0 to the last, closed bin; a
    histogram of one value has CDF 0 below it and 1 from its bin on; an empty one is all 0."""
    np.testing.assert_allclose(M.HIST_EDGES.numpy(), np.logspace(-8, 0, 33), rtol=1e-12)  # 4 bins a decade
    counts = M.weight_histogram(M.HIST_EDGES)  # each edge exactly (NumPy's logspace may differ by an ulp)
    assert counts.tolist() == [0] + [1] * 31 + [2]
    assert counts.dtype == torch.int64 and len(counts) == 33
    one = M.weight_histogram(torch.tensor([0.9]))  # in [10^-0.25, 1]
    assert one.tolist() == [0] * 32 + [1]
    assert M.cdf_from_histogram(one).tolist() == [0.0] * 32 + [1.0]
    assert M.cdf_from_histogram(torch.zeros(33, dtype=torch.long)).tolist() == [0.0] * 33
    assert M.weight_histogram(torch.tensor([0.2, 0.2, 0.2], dtype=torch.float32)).sum() == 3


def test_incoming_attention_by_hand():
    """Two heads, 2 queries x 3 keys; query 1 of head 1 is not counted. raw = sum of counted weights
    per key, relative = sum of weight x (number of the row's attended keys), seen = counted (head, row)
    pairs that attend the key."""
    w = torch.tensor([[[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], [[1.0, 0.0, 0.0], [0.1, 0.1, 0.8]]]], dtype=torch.float64)
    keep = torch.tensor([[[[True, True, False], [True, True, True]], [[True, False, False], [True, True, True]]]])
    rows = torch.tensor([[[True, True], [True, False]]])
    raw, relative, seen = M.incoming_attention(w, keep, rows)
    assert raw.tolist() == [[pytest.approx(1.7), pytest.approx(0.8), pytest.approx(0.5)]]
    assert relative.tolist() == [
        [pytest.approx(0.5 * 2 + 0.2 * 3 + 1.0 * 1), pytest.approx(0.5 * 2 + 0.3 * 3), pytest.approx(0.5 * 3)]
    ]
    assert seen.tolist() == [[3.0, 2.0, 1.0]]


def test_sink_ratio_is_strictly_above_eps_and_ignores_nan():
    relative = torch.tensor([3.0, 3.5, math.nan, 1.0], dtype=torch.float64)
    assert M.sink_ratio(relative, 3.0) == pytest.approx(1 / 3)  # 3.0 itself is not above 3
    assert M.sink_ratio(relative, 0.5) == 1.0
    assert math.isnan(M.sink_ratio(torch.tensor([math.nan, math.nan]), 3.0))


def test_rollout_renormalises_rows_that_do_not_sum_to_1():
    """Padded rows have weights summing to less than 1 (or to 0): Â = (A + I) / (row sum + 1) by
    hand, R_2 = Â_2 Â_1."""
    a1 = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.2, 0.2], [0.0, 0.0, 0.0]]])
    a2 = torch.tensor([[[0.0, 1.0, 0.0], [0.3, 0.0, 0.0], [0.1, 0.1, 0.1]]])
    eye = np.eye(3)

    def a_hat(a):
        a = a[0].double().numpy()
        return (a + eye) / (a.sum(-1, keepdims=True) + 1)

    r1, r2 = M.rollout([a1, a2])
    assert r1.dtype == torch.float64 and r1.shape == (1, 3, 3)
    np.testing.assert_allclose(r1[0].numpy(), a_hat(a1), rtol=1e-12)
    np.testing.assert_allclose(r2[0].numpy(), a_hat(a2) @ a_hat(a1), rtol=1e-12)
    assert r1[0, 2].tolist() == [0.0, 0.0, 1.0]  # a row with no attention rolls out to itself


def test_token_similarity_of_two_tokens_is_their_cosine():
    """n = 2 is the smallest sample with a pair: the mean over (0, 1) and (1, 0) is cos(x0, x1); by hand,
    (1, 0) and (1, 1) have cosine 1/sqrt(2); a sample with no valid token is NaN."""
    x = torch.tensor([[[1.0, 0.0], [1.0, 1.0], [5.0, 5.0]], [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    valid = torch.tensor([[True, True, False], [False, False, False]])
    sim = M.token_similarity(x, valid)
    assert sim[0].item() == pytest.approx(1 / math.sqrt(2), rel=1e-12) and math.isnan(sim[1])
    # all valid: pairs of sample 0 are 1/sqrt2, 1/sqrt2, 1 -> mean (2/sqrt2 + 1) / 3
    assert M.token_similarity(x)[0].item() == pytest.approx((2 / math.sqrt(2) + 1) / 3, rel=1e-12)


def test_thresholds_are_strict_for_a_key_exactly_at_the_row_mean():
    """Centred scores (3, 0, -3): the middle key is neither relevant (needs > 0) nor small (needs < 0),
    so M has no relevant key (undefined) and S averages over the last key only."""
    scores = torch.tensor([[3.0, 0.0, -3.0]], dtype=torch.float64)
    p = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64)
    keys = torch.ones(1, 3, dtype=torch.bool)
    m, s = centred_m_and_s(scores, p, keys)
    assert math.isnan(m)
    soft = np.exp([3.0, 0.0, -3.0])
    s_ref = soft.min() / soft.sum()
    assert s.item() == pytest.approx(math.exp((s_ref - 0.1) / s_ref - 1), rel=1e-12, abs=0)


def test_sparsity_of_a_score_gap_beyond_float64_range_is_1():
    """Scores 400 apart: softmax's smallest probability e^-800 underflows to 0 even in float64; the
    reference s is kept at float64's smallest normal number, so a zero weight still gives the term 1 (not
    0/0 = NaN)."""
    scores = torch.tensor([[400.0, -400.0]], dtype=torch.float64)
    p = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    assert centred_m_and_s(scores, p, torch.ones(1, 2, dtype=torch.bool))[1].item() == 1.0


def test_rollout_and_token_similarity_stay_on_the_input_device():
    """On "meta" tensors (standing in for CUDA ones without a GPU), a tensor made on the CPU by mistake
    fails to combine with the input."""
    assert M.rollout([torch.rand(1, 3, 3, device="meta")] * 2)[1].device.type == "meta"
    assert M.token_similarity(torch.randn(2, 3, 4, device="meta")).device.type == "meta"
