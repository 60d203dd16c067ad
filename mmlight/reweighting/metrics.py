"""Measures of attention weights, row-wise over the last dimension (keys): the paper's M and S
(Section 3.2.1), entropy, and the statistics ``mmlight analyze`` and the ``AttentionStats`` callback
report, as pure functions of the weights and the mask that was used.

Conventions (shapes as recorded by :func:`mmlight.nn.attention.record_attention`):

* ``weights``/``p`` ``(..., Tk)`` (``(B, nh, Tq, Tk)`` when recorded): reweighted probabilities, zero where
  masked;
* ``keep``/``keys`` bool, broadcastable to the weights (True = the key was attended), or None = all keys;
* ``rows`` bool ``(B, nh, Tq)``: the query rows that count (a real query with at least one key).
  Padding queries, and queries whose every key is masked, never count; masked keys never count.
"""

from __future__ import annotations

import math

import torch

#: Log-spaced histogram edges of the weights, 1e-8 .. 1 (the paper's Figure 5). Weights below the
#: first edge (exact zeros included) are counted in a separate underflow bin.
HIST_EDGES = torch.logspace(-8, 0, 33, dtype=torch.float64)


def attended(weights: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Bool ``(B, nh, Tq, Tk)``: True where a key took part in the row."""
    if keep is None:
        return torch.ones_like(weights, dtype=torch.bool)
    return keep.expand_as(weights)


def counted_rows(keys: torch.Tensor, query_keep: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``(B, nh, Tq)``: rows with at least one attended key whose query is real.

    Args:
        keys: :func:`attended`'s result ``(B, nh, Tq, Tk)``.
        query_keep: ``(B, Tq)`` bool, False for padding queries; None = every query is real.
    """
    rows = keys.any(dim=-1)
    if query_keep is not None:
        rows = rows & query_keep[:, None, :]
    return rows


def renormalised(weights: torch.Tensor, mass: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """Each row's weights divided by their sum ``mass`` ``(B, nh, Tq)`` where ``given`` (the row has
    mass), zeros elsewhere: the distribution over keys of a function whose weights need not sum to 1."""
    return torch.where(given[..., None], weights / torch.where(given, mass, 1.0)[..., None], 0.0)


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy ``-sum p log p`` per row in nats, with ``0 log 0 = 0`` (masked weights are 0)."""
    return -torch.where(p > 0, p * p.clamp_min(torch.finfo(p.dtype).tiny).log(), 0.0).sum(-1)


def fraction_below(p: torch.Tensor, threshold: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of the weights of each row below ``threshold`` (masked-out positions not counted).

    Args:
        p: weights ``(..., K)``.
        threshold: e.g. 1e-3 for "near zero".
        mask: optional boolean mask broadcastable to ``p``; True = the position counts.
    """
    counted = torch.ones_like(p, dtype=torch.bool) if mask is None else mask.expand_as(p)
    below = (p < threshold) & counted
    return below.sum(-1) / counted.sum(-1).clamp_min(1)


def normalized_entropy(weights: torch.Tensor, keys: torch.Tensor, nats: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy divided by ``log(number of attended keys)`` per row; NaN for rows with fewer than 2
    keys, where it is undefined (callers skip NaN rows). ``nats``: :func:`entropy` of ``weights``,
    when the caller has it already."""
    n = keys.sum(-1).double()
    nats = entropy(weights.double()) if nats is None else nats
    return torch.where(n >= 2, nats / n.clamp_min(2).log(), math.nan)


def centred_scores(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scores minus their row mean over the attended keys, in float64.

    The thresholds of M and S are applied to these: a key is *relevant* (M) when its score is above
    the row mean plus ``eps_m``, and *small* (S) when below the row mean plus ``eps_s``. The mean of the
    row is the natural scale-free threshold (the paper's Proposition 3.5 uses ``||x||_1 / K``).
    """
    x = scores.double()
    mean = torch.where(keys, x, 0.0).sum(-1, keepdim=True) / keys.sum(-1, keepdim=True).clamp_min(1)
    return x - mean


def multimodality(x: torch.Tensor, p: torch.Tensor, eps: float = 0.0, keys: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-modality M per row (Definition 3.2): ``1 - mean_n (p_max - p_n)`` over the relevant keys, the
    attended keys with ``eps < x_n < x_max``; NaN for a row with none, where M is undefined.

    Args:
        x: scores ``(..., K)`` (``mmlight analyze`` passes :func:`centred_scores`).
        p: weights ``(..., K)`` computed from ``x``.
        eps: relevance threshold on the scores.
        keys: bool, broadcastable to ``x``, True = the key was attended; None = every key.
    """
    if keys is not None:
        x = torch.where(keys, x, -math.inf)  # masked keys: never relevant nor the maximum
    x_max = x.amax(dim=-1, keepdim=True)
    p_max = p.gather(-1, x.argmax(dim=-1, keepdim=True))
    relevant = (x > eps) & (x < x_max)
    gap = torch.where(relevant, p_max - p, 0.0).sum(-1)
    n = relevant.sum(-1)
    return torch.where(n > 0, 1.0 - gap / n.clamp_min(1), math.nan)


def sparsity(
    x: torch.Tensor,
    p: torch.Tensor,
    eps: float = 0.0,
    s: torch.Tensor | float | None = None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparsity S per row (Definition 3.3): ``mean_l exp((s - p_l) / s - 1)`` over the attended keys with
    ``x_l < eps``; NaN for a row with none.

    Larger means sparser: the term is 1 at ``p_l = 0`` and falls off smoothly as ``p_l`` grows past the
    reference ``s``.

    Args:
        x: scores ``(..., K)`` (``mmlight analyze`` passes :func:`centred_scores`).
        p: weights ``(..., K)`` computed from ``x``.
        eps: threshold on the scores below which an entry counts.
        s: reference value in (0, 1]; by default the paper's suggestion, the smallest softmax probability of
            the row's attended scores (computed in float64, kept at least the weights' smallest normal number
            so that a zero weight still gives the term 1 when the softmax underflows).
        keys: bool, broadcastable to ``x``, True = the key was attended; None = every key.
    """
    keys = torch.ones_like(x, dtype=torch.bool) if keys is None else keys.expand_as(x)
    if s is None:
        soft = torch.softmax(torch.where(keys, x.double(), -math.inf), dim=-1)
        s = torch.where(keys, soft, math.inf).amin(-1, keepdim=True).clamp(max=1.0).to(p.dtype)
        s = s.clamp_min(torch.finfo(p.dtype).tiny)
    small = keys & (x < eps)  # masked keys: never "small"
    term = torch.exp((s - p) / s - 1.0)
    n = small.sum(-1)
    return torch.where(n > 0, torch.where(small, term, 0.0).sum(-1) / n.clamp_min(1), math.nan)


def row_max(weights: torch.Tensor) -> torch.Tensor:
    """The largest weight of each row ``(B, nh, Tq)``."""
    return weights.amax(-1)


def weight_histogram(values: torch.Tensor) -> torch.Tensor:
    """Counts ``(len(HIST_EDGES),)`` of 1-D ``values``: entry 0 counts values below 1e-8 (exact zeros
    included), entry ``i`` those in ``[HIST_EDGES[i-1], HIST_EDGES[i])``, the last bin closed at 1."""
    v = values.double().clamp(max=1.0)
    index = torch.bucketize(v, HIST_EDGES.to(v.device), right=True)  # 0 below 1e-8, ..., 33 at exactly 1
    index = index.clamp(max=len(HIST_EDGES) - 1)
    return torch.bincount(index, minlength=len(HIST_EDGES)).cpu()


def cdf_from_histogram(counts: torch.Tensor) -> torch.Tensor:
    """Fraction of the weights below each edge of :data:`HIST_EDGES` (Figure 8), from
    :func:`weight_histogram` counts (below edge ``i`` = entries ``0..i``); the last entry, at 1, is 1."""
    cum = counts.double().cumsum(0)
    return cum / cum[-1].clamp_min(1)


def incoming_attention(weights: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor):
    """What each key position receives, summed over heads and counted rows, per sample.

    Returns ``(raw, relative, seen)``, each ``(B, Tk)``: the summed weights; the summed weights times
    the row's number of attended keys (1 per row under uniform attention, so the mean of ``relative``
    over a row's keys is the row's mass: 1 on the simplex, less for a row that attends partly to
    nothing); and how many (head, row) pairs attended the key. The weights are taken as given, not
    renormalised, so a sink is a key that receives mass actually given. ``raw / seen``
    is the mean incoming attention, ``relative / seen`` the same as a multiple of the uniform share.
    """
    w = torch.where(keys & rows[..., None], weights.double(), 0.0)  # (B, nh, Tq, Tk)
    n_keys = keys.sum(-1, keepdim=True).double()  # (B, nh, Tq, 1)
    seen = (keys & rows[..., None]).sum(dim=(1, 2)).double()  # (B, Tk)
    return w.sum(dim=(1, 2)), (w * n_keys).sum(dim=(1, 2)), seen


def sink_ratio(relative_incoming: torch.Tensor, eps: float) -> float:
    """Fraction of key positions whose mean incoming attention exceeds ``eps`` times the uniform
    share (``relative_incoming`` is that multiple per position; NaN positions are ignored)."""
    valid = ~torch.isnan(relative_incoming)
    return float((relative_incoming[valid] > eps).double().mean()) if valid.any() else math.nan


def rollout(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Attention rollout (Abnar & Zuidema 2020) after each layer.

    Args:
        layers: per layer in depth order, the head-averaged attention ``(B, T, T)``.

    Returns:
        per layer ``R_l = Â_l R_{l-1}`` with ``Â = rownorm(0.5 (A + I))`` and ``R_0 = I``.
    """
    out, current = [], None
    for a in layers:
        a = a.double()
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        a_hat = 0.5 * (a + eye)
        a_hat = a_hat / a_hat.sum(-1, keepdim=True)
        current = a_hat if current is None else a_hat @ current
        out.append(current)
    return out


def rollout_discrepancy(rolled: torch.Tensor, single: torch.Tensor, rows: torch.Tensor) -> tuple[float, int]:
    """Sum over counted rows of the total-variation distance ``0.5 * sum_k |R[q,k] - A[q,k]|``
    between the rollout and the layer's own head-averaged attention, and the number of rows.

    Args:
        rolled: rollout ``(B, T, T)``.
        single: the layer's head-averaged attention ``(B, T, T)``.
        rows: ``(B, T)`` counted query rows.
    """
    tv = 0.5 * (rolled.double() - single.double()).abs().sum(-1)  # (B, T)
    return float(tv[rows].sum()), int(rows.sum())


def token_similarity(tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Mean pairwise cosine similarity of the tokens of each sample, over pairs ``i != j`` of valid
    tokens (Gong et al. 2021's patch similarity); ``(B,)``, NaN for samples with fewer than 2 tokens.

    Args:
        tokens: ``(B, T, d)`` representations.
        valid: ``(B, T)`` bool, False for padding; None = all tokens.
    """
    x = torch.nn.functional.normalize(tokens.double(), dim=-1)
    if valid is None:
        valid = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    x = x * valid[..., None]
    gram_sum = (x.sum(1) ** 2).sum(-1)  # sum_ij <x_i, x_j> = |sum_i x_i|^2
    diag = (x * x).sum((1, 2))
    n = valid.sum(1).double()
    return torch.where(n >= 2, (gram_sum - diag) / (n * (n - 1)).clamp_min(1), math.nan)
