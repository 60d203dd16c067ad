"""Shared masking logic for every reweighting function.

Every function maps scores ``(..., K)`` to non-negative weights over the last dimension: on the
simplex for most, with a sum below one (or unconstrained) for those that may attend to nothing
(:attr:`Reweighting.row_mass`). Masked-out positions (``mask == False``) and ``-inf`` scores get
weight exactly 0; a row with nothing left gets all zeros, never NaN. The work is done in at least
float32 (bf16/fp16 inputs are upcast and the result cast back), float64 inputs stay float64.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from mmlight.reweighting.backend import Backend, check_backend, resolve_backend, run_fused
from mmlight.reweighting.fused import FusedOps

# Masked positions are set this far below the row maximum before normalising. exp(-1e4) is 0 in
# fp32, and every sparse map used here (sparsemax, entmax-1.5, top-k) zeroes anything more than a
# few units below the maximum, so the masked entries get exactly 0 without any -inf arithmetic.
MASKED_GAP = 1e4

#: What a row's weights sum to: ``one`` (the simplex), ``at_most_one`` (the rest, ``1 - sum``, is the
#: row's null mass) or ``unbounded`` (each weight in [0, 1], the sum unconstrained: sigmoid attention).
RowMass = Literal["one", "at_most_one", "unbounded"]


def keep_positions(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Boolean tensor shaped like ``scores``: True where a position takes part in the row.

    Args:
        scores: raw scores ``(..., K)``.
        mask: optional boolean mask broadcastable to ``scores``; True = keep.
    """
    keep = scores != float("-inf")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = keep), got dtype {mask.dtype}")
        keep = keep & mask
    return keep


def shift_and_fill(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Subtract the row maximum over kept entries and put masked entries ``MASKED_GAP`` below it.

    The result is finite everywhere (also for fully masked rows), so forward and backward are NaN-free.
    """
    # A fully masked row's maximum is the dtype's lowest value; every entry of such a row takes the
    # fill, and `where` sends no gradient through the unselected (possibly overflowing) x - row_max.
    row_max = torch.where(keep, x, torch.finfo(x.dtype).min).amax(dim=-1, keepdim=True).detach()
    return torch.where(keep, x - row_max, -MASKED_GAP)


def per_head(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-head parameter ``(nh,)`` shaped to broadcast against scores ``x`` ``(..., nh, Tq, Tk)``.

    One value (``nh == 1``) broadcasts against any shape; otherwise ``x`` must have ``nh`` heads (or
    one, to be broadcast).
    """
    if values.numel() == 1:
        return values.reshape(())
    if x.dim() < 3 or x.shape[-3] not in (1, values.numel()):
        raise ValueError(
            f"a parameter with {values.numel()} heads needs scores (..., {values.numel()}, Tq, Tk), "
            f"got shape {tuple(x.shape)}"
        )
    return values.view(-1, 1, 1)


class Reweighting(nn.Module):
    """Base class: ``forward(scores, mask=None)`` returns weights over the last dimension.

    Subclasses override :meth:`transform` (an elementwise map of the raw scores before masking:
    temperature, MultiMax's sigma) and/or :meth:`normalize` (softmax unless overridden), and
    :meth:`fused` when Triton kernels can compute them. A subclass registered with
    :func:`mmlight.reweighting.register` must be constructible with default arguments (the generic
    tests build it so).

    Args:
        backend: ``auto``, ``reference``, ``compile`` or ``triton``; see
            :mod:`mmlight.reweighting.backend`.
    """

    #: True when the function is plain softmax with a fixed scale, which fused SDPA kernels compute.
    sdpa_scale: float | None = None
    #: True when the function is softmax of the scores times a per-query factor, :meth:`query_scale`,
    #: so that SDPA computes it on scaled queries (Scalable-Softmax).
    scales_queries: bool = False
    #: What every row with a kept entry sums to; the generic tests and the analysis read it.
    row_mass: RowMass = "one"
    #: True when the weights depend on the keys' positions before the query (stick-breaking): the
    #: function refuses non-causal attention when a model is built.
    causal_only: bool = False

    def __init__(self, backend: Backend = "auto"):
        super().__init__()
        self.backend = check_backend(backend)

    def fused(self) -> FusedOps | None:
        """The fused computations this function offers on the ``triton`` backend, or None."""
        return None

    def monitored(self) -> dict[str, torch.Tensor]:
        """Learned quantities to log during training, by name: every trainable parameter of this
        module, unless a subclass reports them in a more readable form (e.g. a temperature
        instead of its logarithm)."""
        return {name: p for name, p in self.named_parameters(recurse=False) if p.requires_grad}

    def query_scale(self, n_keys: torch.Tensor) -> torch.Tensor:
        """With :attr:`scales_queries`: the factor of each query's scores, ``(..., nh|1, Tq, 1)``, for
        ``n_keys`` ``(..., Tq, 1)``, the number of keys each query sees."""
        raise NotImplementedError(f"{type(self).__name__} does not scale queries")

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise map applied to the (finite, fp32) scores before masking. Identity here."""
        return x

    def weights(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Weights for transformed fp32 scores ``x`` ``(..., K)``, finite, 0 outside ``keep``.

        Here: shift by the row maximum over ``keep`` (:func:`shift_and_fill`) and :meth:`normalize`.
        Functions that are not invariant to a shift of the scores, or need the row's size, override
        this instead; the output is zeroed outside ``keep`` after.
        """
        return self.normalize(shift_and_fill(x, keep), keep)

    def normalize(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Map finite fp32 scores ``(..., K)``, max-shifted over ``keep``, to the simplex.

        Entries outside ``keep`` sit ``MASKED_GAP`` below the maximum; their output is zeroed after.
        """
        return torch.softmax(x, dim=-1)

    def forward(self, scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Weights ``(..., K)`` for scores ``(..., K)`` and an optional bool ``mask`` (True = keep)."""
        return self.compute(scores, mask, self.backend)

    def compute(self, scores: torch.Tensor, mask: torch.Tensor | None, backend: Backend) -> torch.Tensor:
        """:meth:`forward` with the backend given per call (attention passes its own)."""
        fused = self.fused()
        resolved = resolve_backend(backend, scores, fused is not None, type(self).__name__)
        if resolved == "triton":
            return run_fused(
                backend,
                f"{type(self).__name__} row-wise",
                fused.rowwise,
                lambda s, m: self.compute(s, m, "compile"),
                scores,
                mask,
            )
        backend = resolved
        # Inside a compiled network the reference is traced into the network's own graph.
        if backend == "compile" and not torch.compiler.is_compiling():
            if getattr(self, "_compiled_reference", None) is None:
                # Instances of one class share the compiled graph (their parameters are graph inputs).
                self._compiled_reference = torch.compile(self.reference)
            return self._compiled_reference(scores, mask)
        return self.reference(scores, mask)

    def reference(self, scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The eager PyTorch definition that every other backend is tested against."""
        keep = keep_positions(scores, mask)
        # -inf scores are masked positions: give the transform a finite stand-in so that
        # sigma(-inf) = -inf + t * inf = NaN never happens.
        x = torch.where(keep, scores.to(torch.promote_types(scores.dtype, torch.float32)), 0.0)
        probs = self.weights(self.transform(x), keep)
        return torch.where(keep, probs, 0.0).to(scores.dtype)
