"""Stick-breaking attention: each query breaks off a share of its stick for the nearest key first.

    w_ij = sigmoid(z_ij) * prod_{j<k<i} (1 - sigmoid(z_ik)),   j < i

Tan, Shen, Yang, Panda & Courville (2025), "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study", ICLR 2025. Query ``i`` attends to the keys before it (not its
own), the nearest first; what no key takes, ``prod_{j<i} (1 - sigmoid(z_ij))``, goes nowhere. The
weights depend on the keys' order, so the function is defined for causal attention only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.registry import register


@register("stickbreaking")
class StickBreaking(Reweighting):
    """Stick-breaking weights of scores ``(..., Tq, Tk)``, in log space:

        log w_ij = logsigmoid(z_ij) + sum_{k kept, j<k<pos(i)} logsigmoid(-z_ik)

    Query ``i`` sits at key position ``pos(i) = Tk - Tq + i`` (the bottom-right alignment of
    :func:`mmlight.nn.attention.causal_mask`, which holds with a key/value cache); it attends to the
    kept keys strictly before it. Keys outside the mask (padding, evicted keys) neither receive
    weight nor break the stick. The first query attends to nothing.

    Args:
        backend: ``auto``, ``reference`` or ``compile`` (no Triton kernel).
    """

    row_mass = "at_most_one"
    causal_only = True

    def weights(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(
                f"stickbreaking needs scores (..., Tq, Tk) to know each query's position, got {tuple(x.shape)}"
            )
        q_len, k_len = x.shape[-2:]
        before = torch.ones(q_len, k_len, dtype=torch.bool, device=x.device).tril(diagonal=k_len - q_len - 1)
        attended = keep & before  # (..., Tq, Tk)
        log_rest = torch.where(attended, F.logsigmoid(-x), 0.0)  # log(1 - sigmoid(z_ik))
        # sum over k > j of log_rest: the suffix sum from j + 1 (exact, no subtraction of partial sums)
        suffix = log_rest.flip(-1).cumsum(-1).flip(-1)
        later = F.pad(suffix[..., 1:], (0, 1))
        return torch.where(attended, torch.exp(F.logsigmoid(x) + later), 0.0)
