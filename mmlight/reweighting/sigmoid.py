"""Sigmoid attention: every key weighed on its own, with no normalisation across the row.

    w_i = sigmoid(x_i + b),   b = -log n

Ramapuram, Danieli, Dhekane, Weers, Busbridge, Ablin, Likhomanenko, Digani, Gu, Shidani & Webb
(2025), "Theory, Analysis, and Best Practices for Sigmoid Self-Attention", ICLR 2025. The bias
``-log n`` (n: the number of keys the query attends to) keeps the row's total near 1 at
initialisation. Each weight lies in [0, 1]; the row's sum is not bounded by 1.
"""

from __future__ import annotations

import math

import torch

from mmlight.reweighting.backend import Backend
from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.registry import register


@register("sigmoid")
class Sigmoid(Reweighting):
    """``sigmoid(x_i + b)`` for each kept entry.

    Args:
        bias: a fixed ``b``; None (default) uses the paper's ``b = -log n`` with ``n`` the number of
            kept keys of the row (under a causal mask, the keys up to the query).
        backend: ``auto``, ``reference`` or ``compile`` (no Triton kernel).
    """

    row_mass = "unbounded"

    def __init__(self, bias: float | None = None, backend: Backend = "auto"):
        super().__init__(backend)
        if bias is not None and not math.isfinite(bias):
            raise ValueError(f"sigmoid bias must be finite, got {bias}")
        self.bias = bias

    def weights(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return torch.sigmoid(x + self.bias)
        n = keep.sum(dim=-1, keepdim=True).clamp_min(1).to(x.dtype)  # a fully masked row is zeroed after
        return torch.sigmoid(x - n.log())

    def extra_repr(self) -> str:
        return f"bias={'-log n' if self.bias is None else self.bias}"
