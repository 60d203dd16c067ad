"""MultiMax (Zhou et al., ICML 2024): softmax of a learned piecewise modulation sigma of the scores.

Eq. 6 of the paper, in the parametrisation of the official code::

    sigma(x) = x + ts[0] * relu(ranges[0] - x) + ts[1] * relu(x - ranges[1])          # first order
                 + ts[2] * relu(ranges[2] - x)**2 + ts[3] * relu(x - ranges[3])**2   # second order

with ``ranges = (b1, d1, b2, d2)`` and ``ts = (1 - t_b1, t_d1 - 1, 1 - t_b2, t_d2 - 1)``. This file
holds the one definition of sigma; every faster backend is tested against it.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmlight.reweighting.backend import Backend, resolve_backend, run_fused
from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.fused import SigmaKernels
from mmlight.reweighting.registry import register


def multimax_sigma(x: torch.Tensor, ranges: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    """The MultiMax modulation sigma(x), elementwise.

    Args:
        x: scores of any shape.
        ranges: ``(2,)`` for first order ``(b, d)``, ``(4,)`` for second order ``(b1, d1, b2, d2)``.
        ts: same shape as ``ranges``: ``(1 - t_b, t_d - 1[, 1 - t_b2, t_d2 - 1])``.
    """
    if ranges.shape != ts.shape or ranges.shape not in ((2,), (4,)):
        raise ValueError(
            f"ranges and ts must both have shape (2,) or (4,), got {tuple(ranges.shape)} and {tuple(ts.shape)}"
        )
    out = x + ts[0] * torch.relu(ranges[0] - x) + ts[1] * torch.relu(x - ranges[1])
    if ranges.shape[0] == 4:
        out = out + ts[2] * torch.relu(ranges[2] - x) ** 2 + ts[3] * torch.relu(x - ranges[3]) ** 2
    return out


def multimax_cross_entropy_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    ranges: torch.Tensor,
    ts: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``cross_entropy(sigma(logits), target)`` in eager PyTorch (fp32 at least): the definition the
    fused kernel :func:`mmlight.kernels.multimax_cross_entropy` is tested against."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(
        multimax_sigma(x, ranges, ts),
        target,
        label_smoothing=label_smoothing,
        ignore_index=ignore_index,
        reduction=reduction,
    )


@functools.cache
def _compiled_cross_entropy():
    """:func:`multimax_cross_entropy_reference` under ``torch.compile``, built on first use."""
    return torch.compile(multimax_cross_entropy_reference)


@register("multimax")
class MultiMax(Reweighting):
    """Learnable MultiMax reweighting; with ``ts == 0`` it is exactly softmax.

    Parameter names and shapes (``ranges``, ``ts``) match the official implementation, so its state
    dicts load. sigma is applied to the raw scores *before* masking (masking first would compute
    -inf * t = NaN).

    Args:
        order: 1 (Eq. 4, piecewise linear) or 2 (Eq. 6, adds the quadratic terms; the paper's default).
        init_std: std of the truncated-normal init of ``ranges`` and ``ts`` (0.02, as the official
            code), so a new layer starts close to softmax. 0 is the identity start: ``ranges = ts = 0``,
            so sigma(x) = x exactly and the layer is softmax until training moves it (fine-tuning
            a pretrained softmax model then starts from that model).
        learnable: if False, the parameters are frozen (useful for analysis with fixed t_b, t_d).
        terms: ``both`` (terms (1) and (2) of Eq. 4/6) or ``low`` (term (1) only, the small-value
            temperature t_b: the paper's MultiMax-l and Table 5's ablation row 2). With ``low`` the
            t_d entries of ``ts`` (``ts[1]``, ``ts[3]``) stay in the official layout but are held at
            0 inside sigma, so their values are ignored and they, and ``d``, get zero gradient.
        backend: ``auto``, ``reference``, ``compile`` or ``triton`` (see :mod:`mmlight.reweighting.backend`).
    """

    def __init__(
        self,
        order: int = 2,
        init_std: float = 0.02,
        learnable: bool = True,
        terms: Literal["both", "low"] = "both",
        backend: Backend = "auto",
    ):
        super().__init__(backend)
        if order not in (1, 2):
            raise ValueError(f"MultiMax order must be 1 or 2, got {order}")
        if terms not in ("both", "low"):
            raise ValueError(f"MultiMax terms must be 'both' or 'low', got {terms!r}")
        self.terms = terms
        n = 2 * order
        if not init_std >= 0:  # also rejects NaN
            raise ValueError(f"MultiMax init_std must be >= 0, got {init_std}")
        self.ranges = nn.Parameter(torch.zeros(n), requires_grad=learnable)
        self.ts = nn.Parameter(torch.zeros(n), requires_grad=learnable)
        if init_std > 0:  # trunc_normal_ divides by std; 0 keeps the identity start
            nn.init.trunc_normal_(self.ranges, std=init_std, a=-2 * init_std, b=2 * init_std)
            nn.init.trunc_normal_(self.ts, std=init_std, a=-2 * init_std, b=2 * init_std)
        if terms == "low":
            with torch.no_grad():
                self.ts.view(order, 2)[:, 1] = 0.0  # unused; 0 so that a saved state dict says so

    @property
    def order(self) -> int:
        return self.ranges.shape[0] // 2

    def active_ts(self) -> torch.Tensor:
        """``ts`` as sigma uses it: with ``terms="low"`` the t_d entries are replaced by 0 (a masked
        copy, so every backend, the Triton kernels included, computes term (1) only and the
        masked entries get zero gradient through autograd)."""
        if self.terms == "both":
            return self.ts
        low = self.ts.view(self.order, 2)[:, :1]  # (order, 1): 1 - t_b per order
        return torch.cat((low, torch.zeros_like(low)), dim=1).flatten()

    def modulate(self, x: torch.Tensor) -> torch.Tensor:
        """sigma(x) alone, e.g. for classifier logits before cross-entropy (the paper's Table 2)."""
        return multimax_sigma(x, self.ranges, self.active_ts())

    def cross_entropy(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Cross-entropy of ``softmax(sigma(logits))`` against hard targets, on this module's backend.

        Args:
            logits: ``(T, V)`` output-layer scores.
            target: ``(T,)`` class indices.
            label_smoothing: as in :func:`torch.nn.functional.cross_entropy`.
            ignore_index: target value that contributes neither loss nor gradient.
            reduction: ``mean`` (over non-ignored targets) or ``sum``.
        """
        backend = resolve_backend(self.backend, logits, True, "MultiMax cross-entropy")
        args = (logits, target, self.ranges, self.active_ts(), label_smoothing, ignore_index, reduction)
        if backend == "triton":
            from mmlight.kernels import multimax_cross_entropy  # imports Triton only when it is used

            return run_fused(
                self.backend,
                "MultiMax cross-entropy",
                multimax_cross_entropy,
                lambda *a: _compiled_cross_entropy()(*a),
                *args,
            )
        if backend == "compile" and not torch.compiler.is_compiling():  # else traced into the caller's graph
            return _compiled_cross_entropy()(*args)
        return multimax_cross_entropy_reference(*args)

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        return self.modulate(x)

    def fused(self) -> SigmaKernels:
        return SigmaKernels(1.0, self.ranges, self.active_ts())

    def extra_repr(self) -> str:
        return f"order={self.order}, terms={self.terms}, backend={self.backend}"
