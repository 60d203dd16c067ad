"""Scalable-Softmax: softmax of the scores scaled by ``s * log n``.

    w_i = exp(s log(n) x_i) / sum_j exp(s log(n) x_j)

Nakanishi, K. M. (2025), "Scalable-Softmax Is Superior for Attention", arXiv:2501.19399. ``n`` is the
number of keys the query attends to (under a causal mask it grows along the sequence), ``s`` a
learnable scale per head. Since the factor is per query row, attention computes it with fused SDPA
on queries scaled by ``s log n_i`` (:meth:`SSMax.query_scale`).
"""

from __future__ import annotations

import torch
from torch import nn

from mmlight.reweighting.backend import Backend
from mmlight.reweighting.base import Reweighting, per_head, shift_and_fill
from mmlight.reweighting.registry import register


@register("ssmax")
class SSMax(Reweighting):
    """``softmax(s * log(n) * x)`` over the kept entries of a row, ``s`` learned per head.

    Args:
        num_heads: how many ``s`` to learn, one per head; the models set it to their head count. 1
            shares one ``s`` across heads (and takes scores of any shape).
        init: the initial ``s`` (0.43, the value of the paper's Figure 1).
        learnable: train ``s``; False keeps it fixed.
        backend: ``auto``, ``reference`` or ``compile``; attention runs it through SDPA whatever
            the backend, outside attention analysis.
    """

    scales_queries = True

    def __init__(self, num_heads: int = 1, init: float = 0.43, learnable: bool = True, backend: Backend = "auto"):
        super().__init__(backend)
        if num_heads < 1:
            raise ValueError(f"ssmax needs num_heads >= 1, got {num_heads}")
        self.s = nn.Parameter(torch.full((num_heads,), float(init)), requires_grad=learnable)

    def query_scale(self, n_keys: torch.Tensor) -> torch.Tensor:
        # (nh, 1, 1) * (..., nh|1, Tq, 1); n_keys = 0 only in rows that attention zeroes after
        return per_head(self.s, n_keys) * n_keys.clamp_min(1).to(self.s.dtype).log()

    def weights(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        n = keep.sum(dim=-1, keepdim=True).clamp_min(1).to(x.dtype)  # (..., Tq, 1)
        return torch.softmax(shift_and_fill(per_head(self.s, x).to(x.dtype) * n.log() * x, keep), dim=-1)

    def extra_repr(self) -> str:
        return f"num_heads={self.s.numel()}"
