"""α-entmax with α learned per head: from softmax-like (α near 1) to sparsemax (α = 2).

    w = argmax_{p in simplex} p·x + H_α(p),   i.e.  w_i = [(α - 1) x_i - τ]_+ ^ (1 / (α - 1))

with τ such that the weights sum to 1 (H_α: the Tsallis α-entropy). Correia, Niculae & Martins
(2019), "Adaptively Sparse Transformers", EMNLP 2019: α ∈ (1, 2] per head, learned with the gradient
of Peters, Niculae & Martins (2019). Computed by the ``entmax`` package's bisection
(``entmax_bisect``), which gives the gradient in α as well as in the scores.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mmlight.reweighting.backend import Backend
from mmlight.reweighting.base import Reweighting, per_head
from mmlight.reweighting.entmax_ops import entmax_bisect, require_entmax
from mmlight.reweighting.registry import register

#: The smallest α - 1 used: the bisection and its α-gradient divide by α - 1 (the package warns
#: that α = 1 does not work), so α is kept at or above 1.01, where α-entmax is close to softmax.
MIN_ALPHA_GAP = 1e-2


@register("alpha_entmax")
class AlphaEntmax(Reweighting):
    """α-entmax over the last dimension, ``α = 1 + sigmoid(a)`` per head (the paper's parametrisation,
    so α stays in (1, 2)); ``a`` is the trained parameter and ``α`` is what is monitored.

    Args:
        num_heads: how many α to learn, one per head; the models set it to their head count. 1 shares
            one α across heads (and takes scores of any shape).
        init: the initial α, in (1, 2) (1.5: entmax-1.5).
        learnable: train α; False keeps it fixed.
        n_iter: bisection steps (the package's default, 50).
        backend: ``auto``, ``reference`` or ``compile`` (no Triton kernel).
    """

    def __init__(
        self, num_heads: int = 1, init: float = 1.5, learnable: bool = True, n_iter: int = 50, backend: Backend = "auto"
    ):
        super().__init__(backend)
        require_entmax("alpha_entmax")
        if num_heads < 1:
            raise ValueError(f"alpha_entmax needs num_heads >= 1, got {num_heads}")
        if not 1 + MIN_ALPHA_GAP <= init < 2:
            raise ValueError(f"alpha_entmax init must lie in [{1 + MIN_ALPHA_GAP}, 2), got {init}")
        self.n_iter = n_iter
        logit = math.log((init - 1) / (2 - init))  # sigmoid(logit) = init - 1
        self.alpha_logit = nn.Parameter(torch.full((num_heads,), logit), requires_grad=learnable)

    @property
    def alpha(self) -> torch.Tensor:
        """α per head, ``(num_heads,)``."""
        return 1 + torch.sigmoid(self.alpha_logit).clamp_min(MIN_ALPHA_GAP)

    def normalize(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        alpha = per_head(self.alpha, x).to(x.dtype)
        return entmax_bisect(x, alpha, self.n_iter)

    def monitored(self) -> dict[str, torch.Tensor]:
        return {"alpha": self.alpha} if self.alpha_logit.requires_grad else {}

    def extra_repr(self) -> str:
        return f"num_heads={self.alpha_logit.numel()}, n_iter={self.n_iter}"
