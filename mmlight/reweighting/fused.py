"""What a reweighting function can compute with fused Triton kernels: its capabilities.

A function that has kernels returns a :class:`FusedOps` from :meth:`Reweighting.fused`; the
row-wise path (``reweighting/base.py``) and attention (``nn/attention.py``) call these methods and
never name a kernel. A second fused function (say, softmax with a learnable temperature) is a new
``FusedOps`` subclass, with no edit to either caller.
"""

from __future__ import annotations

import torch


class FusedOps:
    """The fused computations of one reweighting function. Subclasses implement :meth:`rowwise`
    and may implement :meth:`attention`."""

    def rowwise(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Weights ``(..., K)`` for scores ``(..., K)`` and an optional bool mask (True = keep)."""
        raise NotImplementedError

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        causal: bool,
        key_padding: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Fused attention ``(B, nh, Tq, hv)``, or None when these inputs have no fused kernel (the
        caller then takes the explicit path).

        Args:
            q: queries ``(B, nh, Tq, hs)``.
            k: keys ``(B, nh, Tk, hs)``.
            v: values ``(B, nh, Tk, hv)``.
            scale: the score scale.
            causal: mask future keys (bottom-right aligned).
            key_padding: ``(B, Tk)`` bool, True = attend, or None.
        """
        return None


class SigmaKernels(FusedOps):
    """``softmax(sigma(scale * x))`` with MultiMax's sigma (``ranges``/``ts``), or plain softmax
    with a fixed scale when both are None: the kernels of :mod:`mmlight.kernels`.

    Args:
        scale: multiplies the scores before sigma (a softmax temperature's inverse).
        ranges: MultiMax's breakpoints ``(2,)`` or ``(4,)``, or None for plain softmax.
        ts: MultiMax's slopes, shaped like ``ranges``, or None.
    """

    def __init__(self, scale: float, ranges: torch.Tensor | None, ts: torch.Tensor | None):
        self.scale, self.ranges, self.ts = scale, ranges, ts

    def rowwise(self, scores, mask):
        from mmlight.kernels import multimax_softmax  # imports Triton only when it is used

        return multimax_softmax(scores, mask, self.ranges, self.ts, self.scale)

    def attention(self, q, k, v, scale, causal, key_padding):
        from mmlight.kernels.attention import SUPPORTED_HEAD_DIMS, multimax_attention

        if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
            return None
        return multimax_attention(
            q, k, v, self.ranges, self.ts, scale * self.scale, causal=causal, key_padding=key_padding
        )
