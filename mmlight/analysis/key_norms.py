"""Key norm against the attention a key receives, per causal decoder layer (the Devoto thesis,
Fig. 4.2: the observation behind L2-norm KV eviction, that keys of low norm receive much attention).

For each sample, head and key position ``j`` of a causal decoder self-attention layer, the pair is
``(||k_j||, mean_i w_ij)``, the mean over the **later** counted queries ``i > j`` that see key ``j``
(the attention the key receives while it sits in the cache; a key no later query sees has no pair).
:func:`correlations` gives the Pearson and the Spearman (rank, ties averaged) correlation of the
pairs pooled over samples and heads, per layer. A negative value means low-norm keys receive more.
"""

from __future__ import annotations

import math

import torch

from mmlight.analysis.batches import teacher_forced_pass
from mmlight.analysis.kv_eviction import full_mask
from mmlight.nn.attention import AttentionObserver, explicit_weights


def received_attention(
    weights: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean attention each key receives from the later queries that see it.

    Args:
        weights: ``(B, nh, Tq, Tk)``; query ``i`` sits at position ``Tk - Tq + i``.
        keys: bool, broadcastable to ``weights``: what each query sees.
        rows: bool ``(B, Tq)``: the queries that count (None: all).

    Returns:
        ``(mean, seen)``, ``(B, nh, Tk)`` float64 and bool: the mean, and whether any later counted
        query sees the key (the mean is 0 where not).
    """
    B, nh, Tq, Tk = weights.shape
    query_pos = torch.arange(Tk - Tq, Tk, device=weights.device)[:, None]  # (Tq, 1)
    later = keys.expand(B, nh, Tq, Tk) & (query_pos > torch.arange(Tk, device=weights.device))
    if rows is not None:
        later = later & rows[:, None, :, None]
    count = later.sum(2)  # (B, nh, Tk)
    total = torch.where(later, weights.double(), 0.0).sum(2)
    return total / count.clamp(min=1), count > 0


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n of the 1-D ``x``, tied values sharing the mean of their ranks (float64)."""
    order = x.argsort(stable=True)
    _, inverse, counts = torch.unique_consecutive(x[order], return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()  # the last rank of each group of equal values
    ranks = torch.empty(len(x), dtype=torch.float64, device=x.device)
    ranks[order] = (ends - (counts.double() - 1) / 2)[inverse]
    return ranks


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson's r of two 1-D tensors in float64; NaN where either is constant or has < 2 values."""
    x, y = x.double(), y.double()
    if len(x) < 2:
        return math.nan
    xc, yc = x - x.mean(), y - y.mean()
    denominator = float(xc.norm() * yc.norm())
    return float(xc @ yc) / denominator if denominator > 0 else math.nan


def correlations(norms: torch.Tensor, received: torch.Tensor) -> dict[str, float]:
    """``{"pairs", "pearson", "spearman"}`` of the 1-D ``norms`` and ``received``."""
    return {
        "pairs": len(norms),
        "pearson": pearson(norms, received),
        "spearman": pearson(average_ranks(norms.double()), average_ranks(received.double())),
    }


class KeyNormAttention(AttentionObserver):
    """Collect ``(||k_j||, received attention)`` pairs (see the module docstring) of every causal
    decoder self-attention call, per site: :attr:`pairs` site name -> list of ``(norms, received)``.
    The weights are computed with each site's own reweighting; the mask is left unchanged."""

    def __init__(self):
        self.pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.query_keep: dict[str, torch.Tensor | None] = {}  # the task's query_keep of the current batch

    def edit_mask(self, site, q, k, mask):
        if site.kind != "decoder_self":
            return mask
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, nh, Tk, hs)
        keys = full_mask(q, k, mask)
        reweight = site.module
        weights = explicit_weights(q, k, reweight, keys, q.shape[-1] ** -0.5, reweight.backend)
        keep = self.query_keep.get(site.stack)
        rows = None if keep is None else keep[:, -q.shape[2] :]
        mean, seen = received_attention(weights, keys, rows)
        norms = torch.linalg.vector_norm(k.double(), dim=-1)  # (B, nh, Tk)
        self.pairs.setdefault(site.name, []).append((norms[seen].cpu(), mean[seen].cpu()))
        return mask


def key_norm_attention(task, batches: list) -> dict[str, dict]:
    """Per causal decoder self-attention site of ``task`` (teacher-forced on ``batches``), the pairs
    ``{"norm": [...], "received": [...]}`` and their :func:`correlations`; empty for a task without
    causal decoder self-attention."""
    observer = KeyNormAttention()
    teacher_forced_pass(task, batches, observer)
    out = {}
    for name, parts in observer.pairs.items():
        norms, received = torch.cat([n for n, _ in parts]), torch.cat([r for _, r in parts])
        out[name] = {**correlations(norms, received), "norm": norms.tolist(), "received": received.tolist()}
    return out
