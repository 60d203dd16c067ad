"""MultiMax's sigma inside Triton kernels: the forward map, its derivative and the parameter partials.

The kernels take the modulation as one fp32 tensor of 8 values ``(r0, r1, r2, r3, t0, t1, t2, t3)``
(``ranges`` then ``ts``, zero-padded for first order) and a compile-time ``ORDER``: 0 means no
modulation (plain softmax of ``scale * x``), 1 and 2 are Eqs. 4 and 6 of the paper. The definition
in :func:`mmlight.reweighting.multimax.multimax_sigma` is the reference these helpers are tested
against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_SIGMA_PARAMS = 8


def pack_sigma_params(
    ranges: torch.Tensor | None, ts: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, int]:
    """``(params, order)`` for the kernels: fp32 ``(8,)`` on ``device`` and 0, 1 or 2.

    The packing is differentiable: the kernels' operators return the gradient of the 8 packed
    values (:func:`sum_param_partials`) and autograd carries it back to ``ranges`` and ``ts`` in
    their own dtype and device.

    Args:
        ranges: MultiMax ``ranges``, shape ``(2,)`` or ``(4,)``; None for plain softmax.
        ts: MultiMax ``ts``, same shape as ``ranges``; None for plain softmax.
        device: where the kernels run.
    """
    if ranges is None:
        return torch.zeros(NUM_SIGMA_PARAMS, dtype=torch.float32, device=device), 0
    n = ranges.shape[0]

    def half(p: torch.Tensor) -> torch.Tensor:  # (n,) -> fp32 (4,), zero-padded
        return torch.nn.functional.pad(p.to(device, torch.float32), (0, 4 - n))

    return torch.cat((half(ranges), half(ts))), n // 2


def sum_param_partials(partials: torch.Tensor) -> torch.Tensor:
    """The gradient of the 8 packed parameters: per-program partials ``(programs, 8)`` summed in
    fp32 in a fixed order (deterministic, no atomics)."""
    return partials.sum(dim=0)


@triton.jit
def load_sigma_params(params_ptr):
    """The 8 modulation parameters as fp32 scalars."""
    r0 = tl.load(params_ptr + 0)
    r1 = tl.load(params_ptr + 1)
    r2 = tl.load(params_ptr + 2)
    r3 = tl.load(params_ptr + 3)
    t0 = tl.load(params_ptr + 4)
    t1 = tl.load(params_ptr + 5)
    t2 = tl.load(params_ptr + 6)
    t3 = tl.load(params_ptr + 7)
    return r0, r1, r2, r3, t0, t1, t2, t3


@triton.jit
def sigma_forward(x, r0, r1, r2, r3, t0, t1, t2, t3, ORDER: tl.constexpr):
    """sigma(x) elementwise on an fp32 tile (identity when ``ORDER == 0``)."""
    y = x
    if ORDER >= 1:
        y = y + t0 * tl.maximum(r0 - x, 0.0) + t1 * tl.maximum(x - r1, 0.0)
    if ORDER == 2:
        lo = tl.maximum(r2 - x, 0.0)
        hi = tl.maximum(x - r3, 0.0)
        y = y + t2 * lo * lo + t3 * hi * hi
    return y


@triton.jit
def sigma_derivative(x, r0, r1, r2, r3, t0, t1, t2, t3, ORDER: tl.constexpr):
    """d sigma / dx elementwise on an fp32 tile (relu'(0) = 0, as in PyTorch)."""
    d = tl.full(x.shape, 1.0, tl.float32)
    if ORDER >= 1:
        d = d - tl.where(x < r0, t0, 0.0) + tl.where(x > r1, t1, 0.0)
    if ORDER == 2:
        d = d - 2.0 * t2 * tl.maximum(r2 - x, 0.0) + 2.0 * t3 * tl.maximum(x - r3, 0.0)
    return d


@triton.jit
def _reduce(a, PER_ROW: tl.constexpr):
    """Sum of a 2-D tile over both axes (a scalar), or over axis 1 only (a vector, one per row)."""
    # one return statement: the compiler wants one return type, and only the taken branch exists
    if PER_ROW:
        total = tl.sum(a, axis=1)
    else:
        total = tl.sum(tl.sum(a, axis=1), axis=0)
    return total


@triton.jit
def sigma_param_partials(x, g, r0, r1, r2, r3, t0, t1, t2, t3, ORDER: tl.constexpr, PER_ROW: tl.constexpr):
    """Sums over a 2-D fp32 tile of ``g * d sigma / d theta`` for the 8 parameters.

    ``g`` is the gradient with respect to sigma(x); it must already be 0 at masked positions.
    Returns ``(dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3)`` as fp32 scalars (0 for unused terms), or
    with ``PER_ROW`` as vectors summed over axis 1 only: a loop that accumulates those and reduces
    them once after it spares a cross-warp reduction (shared memory and barriers) per tile.
    """
    zero = _reduce(g * 0.0, PER_ROW)
    dr0 = zero
    dr1 = zero
    dr2 = zero
    dr3 = zero
    dt0 = zero
    dt1 = zero
    dt2 = zero
    dt3 = zero
    if ORDER >= 1:
        lo1 = tl.maximum(r0 - x, 0.0)
        hi1 = tl.maximum(x - r1, 0.0)
        dr0 = t0 * _reduce(tl.where(x < r0, g, 0.0), PER_ROW)
        dr1 = -t1 * _reduce(tl.where(x > r1, g, 0.0), PER_ROW)
        dt0 = _reduce(g * lo1, PER_ROW)
        dt1 = _reduce(g * hi1, PER_ROW)
    if ORDER == 2:
        lo2 = tl.maximum(r2 - x, 0.0)
        hi2 = tl.maximum(x - r3, 0.0)
        dr2 = 2.0 * t2 * _reduce(g * lo2, PER_ROW)
        dr3 = -2.0 * t3 * _reduce(g * hi2, PER_ROW)
        dt2 = _reduce(g * lo2 * lo2, PER_ROW)
        dt3 = _reduce(g * hi2 * hi2, PER_ROW)
    return dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3


@triton.jit
def zero_param_sums(BLOCK: tl.constexpr, PER_ROW: tl.constexpr):
    """Eight zero accumulators for :func:`add_param_partials`: fp32 scalars, or with ``PER_ROW``
    ``(BLOCK,)`` vectors (one per row of the tiles that will be added)."""
    zero = tl.zeros((BLOCK,), tl.float32)
    if not PER_ROW:
        zero = tl.sum(zero, axis=0)
    return zero, zero, zero, zero, zero, zero, zero, zero


@triton.jit
def add_param_partials(dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3,
                       x, g, r0, r1, r2, r3, t0, t1, t2, t3, ORDER: tl.constexpr, PER_ROW: tl.constexpr):
    """The 8 running sums plus one tile's :func:`sigma_param_partials` (same arguments after the sums)."""
    e0, e1, e2, e3, f0, f1, f2, f3 = sigma_param_partials(x, g, r0, r1, r2, r3, t0, t1, t2, t3, ORDER, PER_ROW)
    return dr0 + e0, dr1 + e1, dr2 + e2, dr3 + e3, dt0 + f0, dt1 + f1, dt2 + f2, dt3 + f3


@triton.jit
def pack_param_partials(dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3):
    """The 8 partials as one ``(8,)`` fp32 vector, in the order of the packed parameters."""
    slot = tl.arange(0, 8)
    return (tl.where(slot == 0, dr0, 0.0) + tl.where(slot == 1, dr1, 0.0) + tl.where(slot == 2, dr2, 0.0)
            + tl.where(slot == 3, dr3, 0.0) + tl.where(slot == 4, dt0, 0.0) + tl.where(slot == 5, dt1, 0.0)
            + tl.where(slot == 6, dt2, 0.0) + tl.where(slot == 7, dt3, 0.0))


@triton.jit
def store_param_partials(out_ptr, dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3):
    """Write one program's 8 partials to ``out_ptr[0:8]`` (a row of a ``(programs, 8)`` buffer)."""
    tl.store(out_ptr + 0, dr0)
    tl.store(out_ptr + 1, dr1)
    tl.store(out_ptr + 2, dr2)
    tl.store(out_ptr + 3, dr3)
    tl.store(out_ptr + 4, dt0)
    tl.store(out_ptr + 5, dt1)
    tl.store(out_ptr + 6, dt2)
    tl.store(out_ptr + 7, dt3)
