"""MultiMax (Zhou et al., ICML 2024): softmax of a learned piecewise modulation sigma of the scores.

Eq. 6 of the paper, in the parametrisation of the official code::

    sigma(x) = x + ts[0] * relu(ranges[0] - x) + ts[1] * relu(x - ranges[1])          # first order
                 + ts[2] * relu(ranges[2] - x)**2 + ts[3] * relu(x - ranges[3])**2   # second order

with ``ranges = (b1, d1, b2, d2)`` and ``ts = (1 - t_b1, t_d1 - 1, 1 - t_b2, t_d2 - 1)``. This file
holds the one definition of sigma; every faster backend is tested against it.
"""

from __future__ import annotations

import torch
from torch import nn

from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.registry import register


def multimax_sigma(x: torch.Tensor, ranges: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    """The MultiMax modulation sigma(x), elementwise.

    Args:
        x: scores of any shape.
        ranges: ``(2,)`` for first order ``(b, d)``, ``(4,)`` for second order ``(b1, d1, b2, d2)``.
        ts: same shape as ``ranges``: ``(1 - t_b, t_d - 1[, 1 - t_b2, t_d2 - 1])``.
    """
    if ranges.shape != ts.shape or ranges.shape not in ((2,), (4,)):
        raise ValueError(f"ranges and ts must both have shape (2,) or (4,), got {tuple(ranges.shape)} and {tuple(ts.shape)}")
    out = x + ts[0] * torch.relu(ranges[0] - x) + ts[1] * torch.relu(x - ranges[1])
    if ranges.shape[0] == 4:
        out = out + ts[2] * torch.relu(ranges[2] - x) ** 2 + ts[3] * torch.relu(x - ranges[3]) ** 2
    return out


@register("multimax")
class MultiMax(Reweighting):
    """Learnable MultiMax reweighting; with ``ts == 0`` it is exactly softmax.

    Parameter names and shapes (``ranges``, ``ts``) match the official implementation, so its state
    dicts load. sigma is applied to the raw scores *before* masking (masking first would compute
    -inf * t = NaN).

    Args:
        order: 1 (Eq. 4, piecewise linear) or 2 (Eq. 6, adds the quadratic terms; the paper's default).
        init_std: std of the truncated-normal init of ``ranges`` and ``ts`` (0.02, as the official
            code), so a new layer starts close to softmax.
        learnable: if False, the parameters are frozen (useful for analysis with fixed t_b, t_d).
    """

    def __init__(self, order: int = 2, init_std: float = 0.02, learnable: bool = True):
        super().__init__()
        if order not in (1, 2):
            raise ValueError(f"MultiMax order must be 1 or 2, got {order}")
        n = 2 * order
        self.ranges = nn.Parameter(torch.empty(n), requires_grad=learnable)
        self.ts = nn.Parameter(torch.empty(n), requires_grad=learnable)
        nn.init.trunc_normal_(self.ranges, std=init_std, a=-2 * init_std, b=2 * init_std)
        nn.init.trunc_normal_(self.ts, std=init_std, a=-2 * init_std, b=2 * init_std)

    @property
    def order(self) -> int:
        return self.ranges.shape[0] // 2

    def modulate(self, x: torch.Tensor) -> torch.Tensor:
        """sigma(x) alone, e.g. for classifier logits before cross-entropy (the paper's Table 2)."""
        return multimax_sigma(x, self.ranges, self.ts)

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        return self.modulate(x)

    def extra_repr(self) -> str:
        return f"order={self.order}"
