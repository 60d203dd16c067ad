"""Softmax with a learned sink logit per head (gpt-oss, 2025).

    w_i = exp(x_i) / (exp(b_h) + sum_j exp(x_j))

OpenAI (2025), gpt-oss model card and reference code (``gpt_oss/torch/model.py``, ``sdpa``): the
logit ``b_h`` of head ``h`` joins the row's scaled scores as one more column of the softmax, whose
weight is then dropped. The weights sum to ``sigmoid(lse - b_h) < 1`` (``lse``: the log-sum-exp of
the row's scores); the rest, ``sigmoid(b_h - lse)``, goes nowhere. softmax1 is the case ``b_h = 0``,
fixed (:mod:`mmlight.reweighting.softmax1`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mmlight.reweighting.backend import Backend
from mmlight.reweighting.base import Reweighting, per_head
from mmlight.reweighting.registry import register


def softmax_with_sink(x: torch.Tensor, keep: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``exp(x_i) / (exp(sink) + sum_j exp(x_j))`` over the kept entries of each row, 0 elsewhere.

    The larger of the sink and the row's kept maximum, ``m``, is factored out, so no exponential
    exceeds 1 for any score or sink size; a row with nothing kept gives zeros (all its mass is the sink's).

    Args:
        x: finite scores ``(..., K)`` (fp32 or fp64).
        keep: bool, shaped like ``x``: the entries that take part.
        sink: the extra logit, broadcastable to ``x`` with a last dimension of 1 (a 0-d tensor, or
            ``(nh, 1, 1)`` against ``(..., nh, Tq, K)``), in ``x``'s dtype.
    """
    m = torch.maximum(torch.where(keep, x, sink).amax(dim=-1, keepdim=True), sink).detach()  # (..., 1)
    e = torch.where(keep, torch.exp(x - m), 0.0)
    return e / (torch.exp(sink - m) + e.sum(dim=-1, keepdim=True))


@register("sink")
class Sink(Reweighting):
    """``exp(x_i) / (exp(b_h) + sum_j exp(x_j))`` over the kept entries of a row, ``b_h`` learned per head.

    ``b_h`` is in the units of the scaled scores, as in gpt-oss. Attention computes it on the explicit
    path (scores, then these weights): SDPA returns no log-sum-exp, which an exact fused form needs
    (docs/reweightings.md).

    Args:
        num_heads: how many sink logits to learn, one per head; the models set it to their head count.
            1 shares one logit across heads (and takes scores of any shape).
        init: the initial ``b_h`` (0: softmax1 at the first step).
        learnable: train ``b_h``; False keeps it fixed.
        backend: ``auto``, ``reference`` or ``compile`` (no Triton kernel).
    """

    row_mass = "at_most_one"

    def __init__(self, num_heads: int = 1, init: float = 0.0, learnable: bool = True, backend: Backend = "auto"):
        super().__init__(backend)
        if num_heads < 1:
            raise ValueError(f"sink needs num_heads >= 1, got {num_heads}")
        if not math.isfinite(init):
            raise ValueError(f"sink init must be a finite logit, got {init}")
        self.sink_logit = nn.Parameter(torch.full((num_heads,), float(init)), requires_grad=learnable)

    def weights(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return softmax_with_sink(x, keep, per_head(self.sink_logit, x).to(x.dtype))

    def extra_repr(self) -> str:
        return f"num_heads={self.sink_logit.numel()}"
