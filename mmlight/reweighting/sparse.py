"""Sparse reweighting functions: sparsemax, entmax-1.5 (from the ``entmax`` package), ev-softmax, top-k.

``entmax`` has no mixed-precision support; the base class already runs every function in fp32.
"""

from __future__ import annotations

import torch

from mmlight.reweighting.backend import Backend
from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.entmax_ops import entmax15, require_entmax, sparsemax
from mmlight.reweighting.registry import register


@register("sparsemax")
class Sparsemax(Reweighting):
    """Sparsemax (Martins & Astudillo, 2016): Euclidean projection onto the simplex.

    Args:
        backend: ``auto``, ``reference`` or ``compile`` (no Triton kernel).
    """

    def __init__(self, backend: Backend = "auto"):
        super().__init__(backend)
        require_entmax("sparsemax")  # a missing package is named when the function is built, not at its first call

    def normalize(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return sparsemax(x)


@register("entmax15")
class Entmax15(Reweighting):
    """1.5-entmax (Peters et al., 2019), between softmax (alpha=1) and sparsemax (alpha=2).

    Args:
        backend: ``auto``, ``reference`` or ``compile`` (no Triton kernel).
    """

    def __init__(self, backend: Backend = "auto"):
        super().__init__(backend)
        require_entmax("entmax15")

    def normalize(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return entmax15(x)


@register("evsoftmax")
class EvSoftmax(Reweighting):
    """Evidential softmax (Chen et al., 2021): softmax over the entries at or above the row mean.

    The mean is taken over kept (unmasked) entries. During training the dropped entries keep a
    weight ``eps * exp(x)``, the paper's training-time relaxation, so they still receive gradient;
    in eval mode they are exactly zero.

    Args:
        eps: training-time weight factor of the entries below the mean.
        backend: ``auto``, ``reference`` or ``compile`` (no Triton kernel).
    """

    def __init__(self, eps: float = 1e-6, backend: Backend = "auto"):
        super().__init__(backend)
        self.eps = eps

    def normalize(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        n = keep.sum(dim=-1, keepdim=True).clamp_min(1)
        mean = torch.where(keep, x, 0.0).sum(dim=-1, keepdim=True) / n
        weight = (x >= mean).to(x.dtype) + (self.eps if self.training else 0.0)
        unnorm = weight * torch.exp(x)
        return unnorm / unnorm.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


@register("topk")
class TopK(Reweighting):
    """Top-k softmax (as in KVT, Wang et al., 2022): softmax over the k largest scores of a row.

    Ties at the k-th value are all kept. Rows with fewer than k kept entries keep them all.

    Args:
        k: number of entries kept per row.
        backend: ``auto``, ``reference`` or ``compile`` (no Triton kernel).
    """

    def __init__(self, k: int = 8, backend: Backend = "auto"):
        super().__init__(backend)
        if k < 1:
            raise ValueError(f"top-k needs k >= 1, got {k}")
        self.k = k

    def normalize(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        k = min(self.k, x.shape[-1])
        kth = x.topk(k, dim=-1).values[..., -1:]
        return torch.softmax(torch.where(x >= kth, x, x - 1e4), dim=-1)

    def extra_repr(self) -> str:
        return f"k={self.k}"
