"""Softmax with an extra zero logit ("softmax one", "attention is off by one").

    w_i = exp(x_i) / (1 + sum_j exp(x_j))

Miller, E. (2023), "Attention Is Off By One" (blog post); the same function is the zero sink of
Xiao, Tian, Chen, Han & Lewis (2024), "Efficient Streaming Language Models with Attention Sinks",
ICLR 2024 (their "SoftMax-off-by-One"). The weights sum to ``1 - 1 / (1 + sum_j exp(x_j)) < 1``: a
head with only low scores puts its mass on the absent zero logit, i.e. nowhere.
"""

from __future__ import annotations

import torch

from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.registry import register
from mmlight.reweighting.sink import softmax_with_sink


@register("softmax1")
class Softmax1(Reweighting):
    """``exp(x_i) / (1 + sum_j exp(x_j))`` over the kept entries of a row.

    Computed with the row maximum ``m = max(0, max_j x_j)`` factored out,
    ``exp(x_i - m) / (exp(-m) + sum_j exp(x_j - m))``, so no term exceeds 1 for any score size.

    Args:
        backend: ``auto``, ``reference`` or ``compile`` (no Triton kernel).
    """

    row_mass = "at_most_one"

    def weights(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        # the learned sink's function with its logit fixed at 0 (the zero logit takes part in the maximum)
        return softmax_with_sink(x, keep, x.new_zeros(()))
