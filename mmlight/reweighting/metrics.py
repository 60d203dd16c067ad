"""The paper's measures of a reweighting's output (Section 3.2.1), row-wise over the last dimension.

Each function takes the scores ``x`` that were reweighted and/or the weights ``p`` and returns one
value per row (shape ``x.shape[:-1]``).
"""

from __future__ import annotations

import torch


def multimodality(x: torch.Tensor, p: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Multi-modality M(x) (Definition 3.2): ``1 - mean_n (p_max - p_n)`` over relevant entries.

    Relevant entries are those with ``eps < x_n < x_max``. A row with none is fully "multi-modal"
    in the metric's sense (no gap to average) and gets 1.

    Args:
        x: scores ``(..., K)``.
        p: weights ``(..., K)`` computed from ``x``.
        eps: relevance threshold on the scores.
    """
    x_max = x.amax(dim=-1, keepdim=True)
    p_max = p.gather(-1, x.argmax(dim=-1, keepdim=True))
    relevant = (x > eps) & (x < x_max)
    gap = torch.where(relevant, p_max - p, 0.0).sum(-1)
    n = relevant.sum(-1)
    return 1.0 - gap / n.clamp_min(1)


def sparsity(x: torch.Tensor, p: torch.Tensor, eps: float, s: torch.Tensor | float | None = None) -> torch.Tensor:
    """Sparsity S(x) (Definition 3.3): ``mean_l exp((s - p_l) / s - 1)`` over entries ``x_l < eps``.

    Larger means sparser: the term is 1 at ``p_l = 0`` and falls off smoothly as ``p_l`` grows
    past the reference ``s``. Rows with no entry below ``eps`` get 0.

    Args:
        x: scores ``(..., K)``.
        p: weights ``(..., K)`` computed from ``x``.
        eps: threshold on the scores below which an entry counts.
        s: reference value in (0, 1]; by default the paper's suggestion, ``softmax(x)_min`` per row.
    """
    if s is None:
        s = torch.softmax(x.double(), dim=-1).amin(dim=-1, keepdim=True).to(p.dtype)
    small = x < eps
    term = torch.exp((s - p) / s - 1.0)
    return torch.where(small, term, 0.0).sum(-1) / small.sum(-1).clamp_min(1)


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy ``-sum p log p`` in nats, with ``0 log 0 = 0``."""
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
