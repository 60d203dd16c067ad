"""Softpick: rectified softmax whose weights need not sum to one.

    w_i = relu(exp(x_i) - 1) / (sum_j |exp(x_j) - 1| + eps)

Zuhri, Fuadi & Aji (2025), "Softpick: No Attention Sink, No Massive Activations with Rectified
Softmax", arXiv:2504.20966. Scores at or below 0 get weight 0 but still count in the denominator, so
a row of low scores has little mass in total.
"""

from __future__ import annotations

import torch

from mmlight.reweighting.backend import Backend
from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.registry import register


@register("softpick")
class Softpick(Reweighting):
    """``relu(exp(x_i) - 1) / (sum_j |exp(x_j) - 1| + eps)`` over the kept entries of a row.

    Computed as in the paper's stable form, with ``m = max(0, max_j x_j)`` factored out of
    numerator and denominator: ``relu(exp(x_i - m) - exp(-m)) / (sum_j |exp(x_j - m) - exp(-m)| +
    eps * exp(-m))``; every exponential is then at most 1.

    Args:
        eps: added to the denominator (the paper's epsilon), so a row whose scores are all 0 gets
            zeros rather than 0/0.
        backend: ``auto``, ``reference`` or ``compile`` (no Triton kernel).
    """

    row_mass = "at_most_one"

    def __init__(self, eps: float = 1e-6, backend: Backend = "auto"):
        super().__init__(backend)
        if eps <= 0:
            raise ValueError(f"softpick eps must be positive, got {eps}")
        self.eps = eps

    def weights(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        m = torch.where(keep, x, 0.0).amax(dim=-1, keepdim=True).clamp_min(0.0).detach()
        one = torch.exp(-m)  # exp(0) in the shifted units
        shifted = torch.where(keep, torch.exp(x - m) - one, 0.0)  # exp(x - m) - exp(-m), 0 where masked
        denominator = shifted.abs().sum(dim=-1, keepdim=True) + self.eps * one
        return torch.relu(shifted) / denominator

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
