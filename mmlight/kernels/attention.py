"""Fused MultiMax attention in the FlashAttention-2 style (Triton).

For every (batch, head, query i) the kernel computes, without ever holding the ``Tq x Tk`` matrix::

    x_j = scale * q_i . k_j                  raw scores, one (BLOCK_M, BLOCK_N) tile at a time
    s_j = sigma(x_j)                         MultiMax's modulation (identity for plain softmax)
    s_j = -inf where the key is masked       causal (bottom-right aligned) and/or key padding
    out_i = sum_j softmax(s)_j v_j           online softmax: running max m_i, running sum l_i

sigma is applied to the finite raw scores and the mask afterwards: sigma(-inf) would be
``-inf + t * inf = NaN``. The forward pass saves two fp32 values per row, the final ``m_i`` and
``1 / l_i``, so the backward pass can rebuild ``p_ij = exp(s_ij - m_i) / l_i`` tile by tile with the
forward's own operations. (A single log-sum-exp ``m_i + log l_i`` would save one value, but its fp32
rounding grows with ``|m_i|``, which MultiMax's sigma makes large, and every ``p`` of the row then
errs by the same factor: the parameter gradients, sums over all rows, lost two orders of magnitude
of accuracy against eager fp32.) For the same reason the exponent is ``(s - m) * log2(e)``, not
``s * log2(e) - m'``: the product of a large ``s`` with log2(e) would round each exponent by
``|s| * 2**-24`` before the subtraction, where ``s - m`` is exact for the scores near the maximum,
the ones that carry the weight. A row that sees no key at all gets output 0 and ``1 / l = 0``
(then every recomputed ``p`` is 0 in backward, so
its gradients are 0 too, without any ``-inf - -inf``).

Backward, as in FlashAttention-2, without atomics:

1. ``delta_i = sum_d dO_id * O_id`` (one small kernel), so that ``sum_j p_ij dP_ij = delta_i``.
2. One program per key block accumulates dK and dV over the query blocks that can see it, and also
   the 8 sigma-parameter partials (one row per program of a ``(programs, 8)`` buffer, summed on the
   host in a fixed order, so the parameter gradients are deterministic).
3. One program per query block accumulates dQ over the key blocks it can see.

With ``dP = dO V^T`` and ``g = P * (dP - delta)`` (the gradient with respect to sigma(x), 0 where
masked), ``dx = g * sigma'(x)`` and the gradient with respect to the raw ``q . k`` is ``scale * dx``.
Causal programs skip key blocks that lie entirely in the future of their query block.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmlight.kernels.runtime import TRITON_DTYPES, triton_interpreting
from mmlight.kernels.sigma import (
    NUM_SIGMA_PARAMS,
    add_param_partials,
    load_sigma_params,
    pack_sigma_params,
    sigma_derivative,
    sigma_forward,
    store_param_partials,
    sum_param_partials,
    zero_param_sums,
)
from mmlight.kernels.tiles import BlockConfig, device_capability, measured

__all__ = ["multimax_attention"]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = TRITON_DTYPES  # one list for the kernels and the backend choice
# exp(x) = exp2(x * LOG2E): exp2 is the cheaper instruction on GPUs; x is always a difference s - m
# (see the module docstring)
LOG2E = tl.constexpr(1.4426950408889634)

# The jit decorators (here and in sigma.py) read TRITON_INTERPRET when the module is imported.
_INTERPRETED = triton_interpreting()
# Triton's interpreter stores bf16 as raw uint16 bits and its tl.dot multiplies those integers
# (triton 3.9), so under the interpreter bf16 operands are widened to fp32 first: the products
# of bf16 values are exact in fp32, so the result is what a GPU's bf16 dot with fp32
# accumulation gives. Compiled kernels never take this branch.
_WIDEN_BF16_DOT = tl.constexpr(_INTERPRETED)
# The interpreter sums each score's products itself (see ``_scores``); compiled kernels use tl.dot.
_SUM_SCORES_IN_ORDER = tl.constexpr(_INTERPRETED)

# How tl.dot treats fp32 inputs on the GPU: TF32 tensor cores (10-bit mantissa inputs, fp32
# accumulation), as fused attention kernels usually do. "ieee" (true fp32 FMA) and "tf32x3"
# spill hundreds of bytes of registers per thread at these tile sizes (compiled for sm_90), so
# they are not the default; fp16/bf16 inputs are unaffected. The interpreter computes in fp32.
FP32_DOT_PRECISION = "tf32"

# Kernel switches, each timed by benchmarks/gpu_run.py and set by its switch rule (BENCHMARKS.md).
#: dK/dV kernel: accumulate the sigma-parameter partials per key and reduce them across the warps
#: once per program, after the query loop, instead of to scalars at every query step. On: 11-17%
#: faster forward + backward at every target shape (H200, 2026-12-04).
PARAM_SUMS_PER_PROGRAM = True
#: Forward: write the output ``(B, Tq, H, D)``-contiguous and return it as a ``(B, H, Tq, D)`` view, as
#: SDPA does, so that a caller that merges the heads (``out.transpose(1, 2).reshape(B, Tq, H * D)``)
#: copies nothing.
OUTPUT_IN_CALLER_LAYOUT = False
#: Backward for at most ``SINGLE_PASS_MAX_KEYS`` keys: one kernel that also writes each key block's
#: share of dQ (fp32, summed in a fixed order after it) instead of a second kernel that recomputes
#: the scores, sigma and the weights for dQ.
SINGLE_PASS_BACKWARD = False
#: Forward: the key blocks that all queries of a program see whole (all but the causal diagonal and
#: the last partial block; none with key padding) run without a mask and with unmasked loads.
MASK_FREE_INTERIOR = False
SINGLE_PASS_MAX_KEYS = 256


def forward_config(
    head_dim: int, dtype: torch.dtype, capability: int = 90, causal: bool = False, n: int = 0
) -> BlockConfig:
    """Tiles of the forward kernel (the interpreter ignores warps and stages): the measured row of
    :data:`mmlight.kernels.tiles.MEASURED` where there is one, else the offline choice below.

    128 queries per program amortise each K/V tile over many rows; 64 keys per tile keep the
    fp32 score tile, sigma's temporaries and the (BLOCK_M, D) accumulator in registers. fp32
    inputs have twice the bytes per tile, hence smaller tiles at D = 128. Hopper (sm_90) keeps the
    accumulators of its wgmma instructions in fewer registers than the mma of other GPUs, which
    get narrower key tiles (fp32 at D = 128: more warps).

    Args:
        head_dim: D.
        dtype: dtype of q, k and v.
        capability: compute capability, ``10 * major + minor``.
        causal: causal attention (a key of the measured table).
        n: key length (its bucket is a key of the measured table).
    """
    found = measured("forward", capability, head_dim, dtype, causal, n)
    if found is not None:
        return found
    hopper = capability == 90
    if dtype == torch.float32:
        if head_dim <= 64:
            return BlockConfig(128, 64, 8, 2) if hopper else BlockConfig(128, 32, 8, 2)
        return BlockConfig(64, 32, 4, 2) if hopper else BlockConfig(64, 32, 8, 2)
    if head_dim <= 64:
        return BlockConfig(128, 64, 8, 3) if hopper else BlockConfig(128, 32, 8, 3)
    return BlockConfig(128, 64, 8, 2) if hopper else BlockConfig(128, 32, 8, 2)


def backward_configs(
    head_dim: int, dtype: torch.dtype, capability: int = 90, causal: bool = False, n: int = 0
) -> tuple[BlockConfig, BlockConfig]:
    """Tiles of the dK/dV kernel and of the dQ kernel (whose BLOCK_M the delta kernel shares): each
    the measured row of :data:`mmlight.kernels.tiles.MEASURED` where there is one, else the offline
    choice below.

    Each program keeps a wide block resident (keys for dK/dV, queries for dQ) and steps through
    narrow blocks of the other side. The dK/dV program is the tight one: it holds K, V and two
    fp32 accumulators and recomputes P, dP, sigma'(x) and the 8 parameter sums per tile; off
    Hopper it gets half the queries per step (or half the keys at D = 128) to stay in registers.

    Args:
        head_dim: D.
        dtype: dtype of q, k and v.
        capability: compute capability, ``10 * major + minor``.
        causal: causal attention (a key of the measured table).
        n: key length (its bucket is a key of the measured table).
    """
    dkdv, dq = _offline_backward_configs(head_dim, dtype, capability)
    return (measured("dkdv", capability, head_dim, dtype, causal, n) or dkdv,
            measured("dq", capability, head_dim, dtype, causal, n) or dq)


def _offline_backward_configs(head_dim: int, dtype: torch.dtype, capability: int) -> tuple[BlockConfig, BlockConfig]:
    """The backward tiles chosen offline (see :func:`backward_configs`)."""
    hopper = capability == 90
    if dtype == torch.float32:
        if head_dim <= 64:
            return BlockConfig(16, 64, 4, 2), (BlockConfig(64, 32, 4, 2) if hopper else BlockConfig(32, 32, 4, 2))
        return BlockConfig(16, 32, 4, 2), BlockConfig(32, 32, 4, 2)
    if head_dim <= 64:
        dkdv = BlockConfig(32, 64, 4 if head_dim <= 32 else 8, 2) if hopper else BlockConfig(16, 64, 8, 2)
        return dkdv, BlockConfig(128, 32, 8, 2)
    return (BlockConfig(16, 64, 8, 2) if hopper else BlockConfig(16, 32, 8, 2)), BlockConfig(128, 32, 8, 2)


# How the tile sizes above were chosen, without a GPU at hand: every kernel was compiled for sm_90
# and sm_80 with the specialisations a real launch gets (benchmarks/compile_check.py), and the
# largest tiles were kept that fit in 255 registers per thread without spills and with pipelined
# (cp.async) K/V loads. They are not timed: tune them on the GPU.


# ----------------------------------------------------------------------------- jit helpers


@triton.jit
def _block_and_head(T, BLOCK: tl.constexpr):
    """``(start, bh)``: this program's block of ``T`` and its flat (batch, head) index (int64).

    The grid is 1-D with the blocks of one head adjacent, so neighbouring programs share that
    head's K/V (or Q/dO) in L2; a 1-D grid also avoids the 65535 limit of grid axes 1 and 2.
    """
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(T, BLOCK)
    # int64 head index: head offsets can exceed 2**31 elements
    return (pid % n_blocks) * BLOCK, (pid // n_blocks).to(tl.int64)


@triton.jit
def _load_rows(base, offs_t, offs_d, stride_t, stride_d, T):
    """A (len(offs_t), D) tile of one head; rows past ``T`` read as 0 (finite scores there)."""
    ptrs = base + offs_t[:, None] * stride_t + offs_d[None, :] * stride_d
    return tl.load(ptrs, mask=(offs_t < T)[:, None], other=0.0)


@triton.jit
def _store_rows(base, tile, offs_t, offs_d, stride_t, stride_d, T):
    """Store a (len(offs_t), D) tile, casting to the pointer's dtype; rows past ``T`` are dropped."""
    ptrs = base + offs_t[:, None] * stride_t + offs_d[None, :] * stride_d
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=(offs_t < T)[:, None])


@triton.jit
def _keep_mask(rows_m, cols_n, Tq, Tk, pad_row, stride_pn, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr):
    """Bool tile: True where query ``rows_m`` takes part with key ``cols_n``.

    ``rows_m`` and ``cols_n`` are 2-D and broadcast against each other: (BLOCK_M, 1) and
    (1, BLOCK_N) give a (BLOCK_M, BLOCK_N) tile, (1, BLOCK_M) and (BLOCK_N, 1) its transpose.
    """
    keep = (rows_m < Tq) & (cols_n < Tk)
    if CAUSAL:
        # bottom-right alignment: query i sits at position Tk - Tq + i
        keep = keep & (rows_m + (Tk - Tq) >= cols_n)
    if HAS_PAD:
        pad = tl.load(pad_row + cols_n * stride_pn, mask=cols_n < Tk, other=0)
        keep = keep & (pad != 0)
    return keep


@triton.jit
def _causal_key_end(start_m, Tq, Tk, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key any query in ``[start_m, start_m + BLOCK_M)`` can see."""
    if CAUSAL:
        last_query_end = tl.minimum(start_m + BLOCK_M, Tq)
        return tl.maximum(Tk - Tq + last_query_end, 0)
    return Tk


@triton.jit
def _causal_query_begin(start_n, Tq, Tk, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Start of the first query block (multiple of BLOCK_M) that can see key ``start_n``."""
    if CAUSAL:
        first_query = tl.maximum(start_n - (Tk - Tq), 0)
        return (first_query // BLOCK_M) * BLOCK_M
    return 0


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32 (see ``_WIDEN_BF16_DOT`` for the interpreter detour)."""
    if _WIDEN_BF16_DOT:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _scores(a, b, scale, DOT_PRECISION: tl.constexpr):
    """Raw scaled scores ``scale * a b^T`` in fp32: (R, D) x (C, D) -> (R, C).

    ``(q, k)`` gives the (BLOCK_M, BLOCK_N) score tile, ``(k, q)`` its transpose.

    The backward kernels rebuild ``p = exp(sigma(x) - m) / l`` with the forward's ``m`` and ``l``,
    so every score must come out bit for bit as the forward computed it: an error ``e`` in a
    recomputed ``x`` scales ``p`` by ``exp(sigma'(x) e)`` with no renormalisation to cancel it,
    and sigma' reaches 10-30 with trained second-order parameters. Under the interpreter,
    ``tl.dot`` is NumPy's matmul, whose BLAS picks its kernels (and so its rounding) by matrix
    shape: the forward's (128, 64) tile, the dK/dV kernel's transposed (64, 16) one and the dQ
    kernel's (64, 32) one gave scores one ulp apart, and the dV and sigma-parameter gradients lost
    5-10x in accuracy against eager fp32 (NumPy 2.4 with OpenBLAS 0.3.31). So the interpreter sums
    the D products of each score itself, in one order whatever the tile; a GPU's MMA accumulates
    each output element over D in instruction order, independent of the tile's other sides.
    """
    if _SUM_SCORES_IN_ORDER:
        # (R, 1, D) * (1, C, D) -> (R, C, D), summed over D: the same sum for (q, k) and (k, q);
        # bf16 products are exact in fp32, as in the GPU's dot
        products = a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :]
        return tl.sum(products, axis=2) * scale
    return _dot(a, tl.trans(b), DOT_PRECISION) * scale


@triton.jit
def _grad_tile(x, dp, keep, row_max, row_inv_sum, delta, scale,
               r0, r1, r2, r3, t0, t1, t2, t3, ORDER: tl.constexpr):
    """Recompute one tile of the backward pass from the raw scores ``x`` and ``dP = dO V^T``.

    Works in either orientation: ``row_max`` (of sigma), ``row_inv_sum`` and ``delta``
    (per query) come already broadcastable
    against the tile. Returns ``(p, g, ds)``, fp32 tiles: probabilities, the gradient with
    respect to sigma(x) (0 where masked) and the gradient with respect to the raw ``q . k``.
    """
    # the forward's operations, so p is the forward's (see the module docstring)
    s = tl.where(keep, sigma_forward(x, r0, r1, r2, r3, t0, t1, t2, t3, ORDER), float("-inf"))
    # 1 / l is 0 for rows without keys and s is -inf where masked: both give p = 0, never NaN
    p = tl.exp2((s - row_max) * LOG2E) * row_inv_sum
    g = p * (dp - delta)
    ds = g * sigma_derivative(x, r0, r1, r2, r3, t0, t1, t2, t3, ORDER) * scale
    return p, g, ds


# ----------------------------------------------------------------------------- forward


@triton.jit
def _unmasked_key_end(start_m, Tq, Tk, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """End of the whole key blocks (a multiple of BLOCK_N) that every query from ``start_m`` on sees."""
    seen = Tk
    if CAUSAL:
        # the block's first query sees keys up to Tk - Tq + start_m (bottom-right aligned)
        seen = tl.minimum(tl.maximum(Tk - Tq + start_m + 1, 0), Tk)
    return (seen // BLOCK_N) * BLOCK_N


@triton.jit
def _forward_tile(q, k_head, v_head, start_n, offs_m, offs_d, stride_kt, stride_kd, stride_vt, stride_vd,
                  Tq, Tk, pad_row, stride_pn, scale, r0, r1, r2, r3, t0, t1, t2, t3, m_i, l_i, acc,
                  BLOCK_N: tl.constexpr, ORDER: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr,
                  MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key block of the online softmax: the updated ``(m_i, l_i, acc)``.

    Unless ``MASKED``, every query of the block sees every key of this block (an interior tile): the
    loads and the scores need no mask, and the row max is finite."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        k = _load_rows(k_head, offs_n, offs_d, stride_kt, stride_kd, Tk)  # (BLOCK_N, D)
        v = _load_rows(v_head, offs_n, offs_d, stride_vt, stride_vd, Tk)  # (BLOCK_N, D)
    else:
        k = tl.load(k_head + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd)
        v = tl.load(v_head + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd)
    x = _scores(q, k, scale, DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    s = sigma_forward(x, r0, r1, r2, r3, t0, t1, t2, t3, ORDER)
    if MASKED:
        keep = _keep_mask(offs_m[:, None], offs_n[None, :], Tq, Tk, pad_row, stride_pn, CAUSAL, HAS_PAD)
        s = tl.where(keep, s, float("-inf"))  # (BLOCK_M, BLOCK_N)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (BLOCK_M,)
    if MASKED:
        # a row with no key so far keeps m = -inf; shift by 0 then, so exp2(-inf - 0) = 0
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    p = tl.exp2((s - m_shift[:, None]) * LOG2E)  # (BLOCK_M, BLOCK_N)
    alpha = tl.exp2((m_i - m_shift) * LOG2E)  # (BLOCK_M,) rescales the old sums to the new max
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _forward_kernel(
    Q, K, V, O, ROW_MAX, ROW_INV_SUM, PAD, PARAMS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_pb, stride_pn,
    H, GROUP, Tq, Tk, scale,
    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ORDER: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, MASK_FREE_INTERIOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: BLOCK_M queries of one (batch, head) against all keys they can see."""
    start_m, bh = _block_and_head(Tq, BLOCK_M)
    b = bh // H
    h = bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    k_head = K + b * stride_kb + (h // GROUP) * stride_kh  # grouped-query: GROUP query heads share one
    v_head = V + b * stride_vb + (h // GROUP) * stride_vh
    pad_row = PAD + b * stride_pb
    r0, r1, r2, r3, t0, t1, t2, t3 = load_sigma_params(PARAMS)

    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, stride_qt, stride_qd, Tq)  # (BLOCK_M, D)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max of s
    l_i = tl.zeros((BLOCK_M,), tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros((BLOCK_M, HEAD_D), tl.float32)

    key_end = _causal_key_end(start_m, Tq, Tk, BLOCK_M, CAUSAL)
    # key blocks that every query of this block sees whole: no mask to compute, no masked load
    full_end = _unmasked_key_end(start_m, Tq, Tk, BLOCK_N, CAUSAL) if MASK_FREE_INTERIOR and not HAS_PAD else 0
    for start_n in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _forward_tile(q, k_head, v_head, start_n, offs_m, offs_d, stride_kt, stride_kd, stride_vt,
                                      stride_vd, Tq, Tk, pad_row, stride_pn, scale, r0, r1, r2, r3, t0, t1, t2, t3,
                                      m_i, l_i, acc, BLOCK_N, ORDER, CAUSAL, HAS_PAD, False, DOT_PRECISION)
    for start_n in range(full_end, key_end, BLOCK_N):
        m_i, l_i, acc = _forward_tile(q, k_head, v_head, start_n, offs_m, offs_d, stride_kt, stride_kd, stride_vt,
                                      stride_vd, Tq, Tk, pad_row, stride_pn, scale, r0, r1, r2, r3, t0, t1, t2, t3,
                                      m_i, l_i, acc, BLOCK_N, ORDER, CAUSAL, HAS_PAD, True, DOT_PRECISION)

    has_key = l_i > 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]  # rows without keys: acc = 0, so out = 0
    _store_rows(O + b * stride_ob + h * stride_oh, out, offs_m, offs_d, stride_ot, stride_od, Tq)
    # the shift the last p used (0 for rows without keys) and 1 / l (0 there): backward's p
    tl.store(ROW_MAX + bh * Tq + offs_m, tl.where(m_i == float("-inf"), 0.0, m_i), mask=offs_m < Tq)
    tl.store(ROW_INV_SUM + bh * Tq + offs_m, tl.where(has_key, 1.0 / tl.where(has_key, l_i, 1.0), 0.0),
             mask=offs_m < Tq)


# ----------------------------------------------------------------------------- backward


@triton.jit
def _delta_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_dob, stride_doh, stride_dot, stride_dod,
    H, Tq,
    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta_i = sum_d dO_id * O_id in fp32, for BLOCK_M rows of one (batch, head)."""
    start_m, bh = _block_and_head(Tq, BLOCK_M)
    b = bh // H
    h = bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    o = _load_rows(O + b * stride_ob + h * stride_oh, offs_m, offs_d, stride_ot, stride_od, Tq)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, offs_m, offs_d, stride_dot, stride_dod, Tq)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # (BLOCK_M,)
    tl.store(DELTA + bh * Tq + offs_m, delta, mask=offs_m < Tq)


@triton.jit
def _backward_dkdv_kernel(
    Q, K, V, DO, ROW_MAX, ROW_INV_SUM, DELTA, PAD, PARAMS, DK, DV, PARTIALS, DQ_PARTS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    stride_pb, stride_pn,
    H, GROUP, Tq, Tk, scale,
    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ORDER: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, PARAM_GRADS: tl.constexpr,
    PARAM_SUMS_PER_PROGRAM: tl.constexpr, DQ_PARTIALS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: dK, dV (and the sigma-parameter partials) of BLOCK_N keys of one (batch, head).

    With ``DQ_PARTIALS`` it also writes this key block's share of dQ for every query step, fp32, to
    ``DQ_PARTS[key block, bh, query, :]`` (a ``(key blocks, B * H, Tq, D)`` buffer): summed over the
    key blocks in a fixed order on the host, that is dQ without the dQ kernel's second pass.
    """
    start_n, bh = _block_and_head(Tk, BLOCK_N)
    b = bh // H
    h = bh % H
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    q_head = Q + b * stride_qb + h * stride_qh
    do_head = DO + b * stride_dob + h * stride_doh
    pad_row = PAD + b * stride_pb
    r0, r1, r2, r3, t0, t1, t2, t3 = load_sigma_params(PARAMS)

    # the key/value head of query head h; dK, dV are written per query head and summed over a group on the host
    kv_h = h // GROUP
    k = _load_rows(K + b * stride_kb + kv_h * stride_kh, offs_n, offs_d, stride_kt, stride_kd, Tk)  # (BLOCK_N, D)
    v = _load_rows(V + b * stride_vb + kv_h * stride_vh, offs_n, offs_d, stride_vt, stride_vd, Tk)  # (BLOCK_N, D)
    dk = tl.zeros((BLOCK_N, HEAD_D), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_D), tl.float32)
    # per-program parameter partials, kept in registers (no atomics): per key, reduced over the keys
    # once after the loop (PARAM_SUMS_PER_PROGRAM), or reduced to scalars at every step
    dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3 = zero_param_sums(BLOCK_N, PARAM_SUMS_PER_PROGRAM)

    for start_m in range(_causal_query_begin(start_n, Tq, Tk, BLOCK_M, CAUSAL), Tq, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(q_head, offs_m, offs_d, stride_qt, stride_qd, Tq)  # (BLOCK_M, D)
        do = _load_rows(do_head, offs_m, offs_d, stride_dot, stride_dod, Tq)  # (BLOCK_M, D)
        row_max = tl.load(ROW_MAX + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)  # (BLOCK_M,)
        row_inv_sum = tl.load(ROW_INV_SUM + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)  # (BLOCK_M,)
        delta = tl.load(DELTA + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)  # (BLOCK_M,)
        # work on the transposed tile (keys x queries): then P^T and dS^T come straight out of
        # the dots in the accumulator layout and feed the dK, dV dots without a transpose
        xt = _scores(k, q, scale, DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        dpt = _dot(v, tl.trans(do), DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        keep = _keep_mask(offs_m[None, :], offs_n[:, None], Tq, Tk, pad_row, stride_pn, CAUSAL, HAS_PAD)
        pt, gt, dst = _grad_tile(xt, dpt, keep, row_max[None, :], row_inv_sum[None, :], delta[None, :], scale,
                                 r0, r1, r2, r3, t0, t1, t2, t3, ORDER)
        dv += _dot(pt.to(do.dtype), do, DOT_PRECISION)  # (BLOCK_N, D)
        dk += _dot(dst.to(q.dtype), q, DOT_PRECISION)  # (BLOCK_N, D)
        if DQ_PARTIALS:
            # each (key block, query) row is written by exactly one program: deterministic
            dq_part = _dot(tl.trans(dst).to(k.dtype), k, DOT_PRECISION)  # (BLOCK_M, D)
            n_heads = tl.num_programs(0) // tl.cdiv(Tk, BLOCK_N)  # B * H
            dq_rows = DQ_PARTS + ((start_n // BLOCK_N) * n_heads + bh) * Tq * HEAD_D
            tl.store(dq_rows + offs_m[:, None] * HEAD_D + offs_d[None, :], dq_part, mask=(offs_m < Tq)[:, None])
        if PARAM_GRADS:
            # each (query, key) pair is visited by exactly one dK/dV program: nothing counted twice
            dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3 = add_param_partials(
                dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3,
                xt, gt, r0, r1, r2, r3, t0, t1, t2, t3, ORDER, PARAM_SUMS_PER_PROGRAM)

    _store_rows(DK + b * stride_dkb + h * stride_dkh, dk, offs_n, offs_d, stride_dkt, stride_dkd, Tk)
    _store_rows(DV + b * stride_dvb + h * stride_dvh, dv, offs_n, offs_d, stride_dvt, stride_dvd, Tk)
    if PARAM_GRADS:
        if PARAM_SUMS_PER_PROGRAM:
            store_param_partials(PARTIALS + tl.program_id(0) * 8, tl.sum(dr0, axis=0), tl.sum(dr1, axis=0),
                                 tl.sum(dr2, axis=0), tl.sum(dr3, axis=0), tl.sum(dt0, axis=0),
                                 tl.sum(dt1, axis=0), tl.sum(dt2, axis=0), tl.sum(dt3, axis=0))
        else:
            store_param_partials(PARTIALS + tl.program_id(0) * 8, dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3)


@triton.jit
def _backward_dq_kernel(
    Q, K, V, DO, ROW_MAX, ROW_INV_SUM, DELTA, PAD, PARAMS, DQ,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    stride_pb, stride_pn,
    H, GROUP, Tq, Tk, scale,
    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ORDER: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: dQ of BLOCK_M queries of one (batch, head), looping over the keys they see."""
    start_m, bh = _block_and_head(Tq, BLOCK_M)
    b = bh // H
    h = bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    k_head = K + b * stride_kb + (h // GROUP) * stride_kh  # grouped-query: GROUP query heads share one
    v_head = V + b * stride_vb + (h // GROUP) * stride_vh
    pad_row = PAD + b * stride_pb
    r0, r1, r2, r3, t0, t1, t2, t3 = load_sigma_params(PARAMS)

    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, stride_qt, stride_qd, Tq)  # (BLOCK_M, D)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, offs_m, offs_d, stride_dot, stride_dod, Tq)  # (BLOCK_M, D)
    row_max = tl.load(ROW_MAX + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)  # (BLOCK_M,)
    row_inv_sum = tl.load(ROW_INV_SUM + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)  # (BLOCK_M,)
    delta = tl.load(DELTA + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)  # (BLOCK_M,)
    dq = tl.zeros((BLOCK_M, HEAD_D), tl.float32)

    for start_n in range(0, _causal_key_end(start_m, Tq, Tk, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_head, offs_n, offs_d, stride_kt, stride_kd, Tk)  # (BLOCK_N, D)
        v = _load_rows(v_head, offs_n, offs_d, stride_vt, stride_vd, Tk)  # (BLOCK_N, D)
        x = _scores(q, k, scale, DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        dp = _dot(do, tl.trans(v), DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        keep = _keep_mask(offs_m[:, None], offs_n[None, :], Tq, Tk, pad_row, stride_pn, CAUSAL, HAS_PAD)
        _, _, ds = _grad_tile(x, dp, keep, row_max[:, None], row_inv_sum[:, None], delta[:, None], scale,
                              r0, r1, r2, r3, t0, t1, t2, t3, ORDER)
        dq += _dot(ds.to(k.dtype), k, DOT_PRECISION)  # (BLOCK_M, D)

    _store_rows(DQ + b * stride_dqb + h * stride_dqh, dq, offs_m, offs_d, stride_dqt, stride_dqd, Tq)


# ----------------------------------------------------------------------------- host side


def _padding_arg(key_padding: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, int, int]:
    """``(tensor, stride_b, stride_n)`` for the kernels; a dummy byte when there is no padding."""
    if key_padding is None:
        return torch.zeros(1, dtype=torch.uint8, device=device), 0, 0
    pad = key_padding.view(torch.uint8)  # same bytes, no copy; Triton loads it as integers
    return pad, pad.stride(0), pad.stride(1)


def _forward(q, k, v, params, order, scale, causal, key_padding):
    """Launch the forward kernel; returns ``(out, row_max, row_inv_sum)``: ``(B, H, Tq, D)`` in q's
    dtype (see ``OUTPUT_IN_CALLER_LAYOUT`` for its strides), and per query the max ``m`` of sigma
    and ``1 / sum exp(sigma - m)``, fp32 ``(B, H, Tq)``."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if OUTPUT_IN_CALLER_LAYOUT:
        out = torch.empty((B, Tq, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    else:
        out = torch.empty((B, H, Tq, D), dtype=q.dtype, device=q.device)
    row_max = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    row_inv_sum = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    pad, stride_pb, stride_pn = _padding_arg(key_padding, q.device)
    cfg = forward_config(D, q.dtype, device_capability(q.device), causal, Tk)
    _forward_kernel[(triton.cdiv(Tq, cfg.block_m) * B * H,)](
        q, k, v, out, row_max, row_inv_sum, pad, params,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        stride_pb, stride_pn,
        H, H // k.shape[1], Tq, Tk, scale,
        HEAD_D=D, ORDER=order, CAUSAL=causal, HAS_PAD=key_padding is not None,
        MASK_FREE_INTERIOR=MASK_FREE_INTERIOR, DOT_PRECISION=FP32_DOT_PRECISION, **_tile_args(cfg),
    )
    return out, row_max, row_inv_sum


def _tile_args(cfg: BlockConfig) -> dict:
    """Launch keywords for a kernel taking BLOCK_M and BLOCK_N."""
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _delta(out: torch.Tensor, dout: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    """``delta = rowsum(dout * out)`` as fp32 ``(B, H, Tq)``."""
    B, H, Tq, D = out.shape
    delta = torch.empty((B, H, Tq), dtype=torch.float32, device=out.device)
    _delta_kernel[(triton.cdiv(Tq, cfg.block_m) * B * H,)](
        out, dout, delta, *out.stride(), *dout.stride(), H, Tq,
        HEAD_D=D, BLOCK_M=cfg.block_m, num_warps=cfg.num_warps,
    )
    return delta


def _backward(q, k, v, out, dout, row_max, row_inv_sum, params, key_padding, order, scale, causal,
              want_dq, want_dkdv, want_params):
    """Launch the backward kernels; returns ``(dq, dk, dv, partials)`` (None where not wanted)."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    cfg_kv, cfg_q = backward_configs(D, q.dtype, device_capability(q.device), causal, Tk)
    pad, stride_pb, stride_pn = _padding_arg(key_padding, q.device)
    common = dict(
        HEAD_D=D, ORDER=order, CAUSAL=causal, HAS_PAD=key_padding is not None,
        DOT_PRECISION=FP32_DOT_PRECISION,
    )

    delta = _delta(out, dout, cfg_q)

    dq = dk = dv = partials = None
    # one pass for short keys: the dK/dV kernel also writes dQ per key block (see DQ_PARTIALS)
    single_pass = SINGLE_PASS_BACKWARD and want_dq and (want_dkdv or want_params) and Tk <= SINGLE_PASS_MAX_KEYS
    group = H // k.shape[1]  # query heads per key/value head (grouped-query attention)
    if want_dkdv or want_params:
        # per query head; a group's shares are summed below (fp32 for a group, so the sum rounds once)
        dtype = k.dtype if group == 1 else torch.float32
        dk = torch.empty((B, H, Tk, D), dtype=dtype, device=q.device)
        dv = torch.empty((B, H, Tk, D), dtype=dtype, device=q.device)
        key_blocks = triton.cdiv(Tk, cfg_kv.block_n)
        programs = key_blocks * B * H
        # one row per program; a dummy when the parameters need no gradient
        partials = torch.empty((programs if want_params else 1, NUM_SIGMA_PARAMS),
                               dtype=torch.float32, device=q.device)
        # causal programs skip the queries before their keys: their rows of the buffer stay 0
        new_parts = torch.zeros if causal else torch.empty
        dq_parts = new_parts((key_blocks, B * H, Tq, D) if single_pass else (1,), dtype=torch.float32,
                             device=q.device)
        _backward_dkdv_kernel[(programs,)](
            q, k, v, dout, row_max, row_inv_sum, delta, pad, params, dk, dv, partials, dq_parts,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
            stride_pb, stride_pn, H, group, Tq, Tk, scale, PARAM_GRADS=want_params,
            PARAM_SUMS_PER_PROGRAM=PARAM_SUMS_PER_PROGRAM, DQ_PARTIALS=single_pass, **common,
            **_tile_args(cfg_kv),
        )
        if group > 1:  # (B, Hk, group, Tk, D) summed in a fixed order: deterministic
            dk = dk.view(B, H // group, group, Tk, D).sum(dim=2).to(k.dtype)
            dv = dv.view(B, H // group, group, Tk, D).sum(dim=2).to(v.dtype)
        if single_pass:
            dq = dq_parts.sum(dim=0).view(B, H, Tq, D).to(q.dtype)  # a fixed order: deterministic
    if want_dq and not single_pass:
        dq = torch.empty((B, H, Tq, D), dtype=q.dtype, device=q.device)
        _backward_dq_kernel[(triton.cdiv(Tq, cfg_q.block_m) * B * H,)](
            q, k, v, dout, row_max, row_inv_sum, delta, pad, params, dq,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
            stride_pb, stride_pn, H, group, Tq, Tk, scale, **common,
            **_tile_args(cfg_q),
        )
    return dq, dk, dv, (partials if want_params else None)


# The kernels as operators of torch.library: torch.compile calls them as opaque operators (their
# fake functions give the output shapes), and autograd pairs the forward with the backward operator.
@torch.library.custom_op("mmlight::multimax_attention_forward", mutates_args=())
def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: torch.Tensor, order: int, scale: float,
    causal: bool, key_padding: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, row_max, row_inv_sum)`` of :func:`_forward`; ``params`` the packed fp32 ``(8,)``."""
    return _forward(q, k, v, params, order, scale, causal, key_padding)


@_attention_forward.register_fake
def _(q, k, v, params, order, scale, causal, key_padding):
    B, H, Tq, D = q.shape
    stat = q.new_empty((B, H, Tq), dtype=torch.float32)
    # the strides of the real output (OUTPUT_IN_CALLER_LAYOUT), so that a compiled graph sees them
    out = q.new_empty((B, Tq, H, D)).transpose(1, 2) if OUTPUT_IN_CALLER_LAYOUT else q.new_empty(q.shape)
    return out, stat, torch.empty_like(stat)


@torch.library.custom_op("mmlight::multimax_attention_backward", mutates_args=())
def _attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
    row_max: torch.Tensor, row_inv_sum: torch.Tensor, params: torch.Tensor, key_padding: torch.Tensor | None,
    order: int, scale: float, causal: bool, want_dq: bool, want_dkdv: bool, want_params: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, d_params)``; an empty tensor stands for each gradient not wanted."""
    dq, dk, dv, partials = _backward(q, k, v, out, dout, row_max, row_inv_sum, params, key_padding, order,
                                     scale, causal, want_dq, want_dkdv, want_params)
    def none():  # a fresh empty tensor each time: outputs may not alias each other
        return q.new_empty(0)

    return (dq if want_dq else none(), dk if want_dkdv else none(), dv if want_dkdv else none(),
            sum_param_partials(partials) if want_params else none())


@_attention_backward.register_fake
def _(q, k, v, out, dout, row_max, row_inv_sum, params, key_padding, order, scale, causal,
      want_dq, want_dkdv, want_params):
    def none():  # a fresh empty tensor each time: outputs may not alias each other
        return q.new_empty(0)

    return (q.new_empty(q.shape) if want_dq else none(), k.new_empty(k.shape) if want_dkdv else none(),
            v.new_empty(v.shape) if want_dkdv else none(),
            params.new_empty(NUM_SIGMA_PARAMS) if want_params else none())


def _attention_setup(ctx, inputs, output):
    q, k, v, params, order, scale, causal, key_padding = inputs
    out, row_max, row_inv_sum = output
    ctx.save_for_backward(q, k, v, out, row_max, row_inv_sum, params, key_padding)
    ctx.order, ctx.scale, ctx.causal = order, scale, causal


def _attention_grad(ctx, dout, _d_row_max, _d_row_inv_sum):
    need = ctx.needs_input_grad
    want_dq, want_dkdv, want_params = need[0], need[1] or need[2], ctx.order > 0 and need[3]
    q, k, v, out, row_max, row_inv_sum, params, key_padding = ctx.saved_tensors
    dq, dk, dv, d_params = _attention_backward(
        q, k, v, out, dout, row_max, row_inv_sum, params, key_padding, ctx.order, ctx.scale, ctx.causal,
        want_dq, want_dkdv, want_params,
    )
    return (dq if want_dq else None, dk if need[1] else None, dv if need[2] else None,
            d_params if want_params else None, None, None, None, None)


_attention_forward.register_autograd(_attention_grad, setup_context=_attention_setup)


def _attention(q, k, v, ranges, ts, scale, causal, key_padding):
    """The fused attention ``(B, H, Tq, D)`` on checked inputs (what :func:`multimax_attention` runs)."""
    params, order = pack_sigma_params(ranges, ts, q.device)
    return _attention_forward(q, k, v, params, order, scale, causal, key_padding)[0]


def _check_inputs(q, k, v, ranges, ts, key_padding) -> None:
    """Raise ``ValueError`` for anything the kernels cannot run, before any launch."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, H, T, D), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    B, H, Tq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, H, Tk, D), got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[1] < 1 or H % k.shape[1] or k.shape[3] != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in B, D or heads "
                         "(the key/value heads must divide the query heads)")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D={D} is not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if min(B, H, Tq, k.shape[2]) == 0:
        raise ValueError(f"empty inputs are not supported: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not _INTERPRETED:
        raise ValueError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
                         "mmlight.kernels is imported to run on CPU")
    _check_sigma_params(ranges, ts)
    if key_padding is not None:
        if not isinstance(key_padding, torch.Tensor) or key_padding.dtype != torch.bool:
            raise ValueError("key_padding must be a bool tensor (True = keep)")
        if key_padding.shape != (B, k.shape[2]):
            raise ValueError(f"key_padding must have shape (B, Tk) = {(B, k.shape[2])}, got {tuple(key_padding.shape)}")
        if key_padding.device != q.device:
            raise ValueError(f"key_padding is on {key_padding.device}, q on {q.device}")


def _check_sigma_params(ranges, ts) -> None:
    """Both None (plain softmax) or two floating tensors of equal shape (2,) or (4,)."""
    if (ranges is None) != (ts is None):
        raise ValueError("pass both ranges and ts, or neither (plain softmax)")
    if ranges is None:
        return
    if not isinstance(ranges, torch.Tensor) or not isinstance(ts, torch.Tensor):
        raise ValueError("ranges and ts must be tensors")
    if ranges.shape != ts.shape or ranges.shape not in ((2,), (4,)):
        raise ValueError(f"ranges and ts must both have shape (2,) or (4,), "
                         f"got {tuple(ranges.shape)} and {tuple(ts.shape)}")
    if not (ranges.is_floating_point() and ts.is_floating_point()):
        raise ValueError(f"ranges and ts must be floating point, got {ranges.dtype} and {ts.dtype}")


def multimax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: torch.Tensor | None = None,
    ts: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused attention ``softmax(sigma(scale * q k^T) masked) v`` without the (Tq, Tk) matrix.

    Differentiable with respect to q, k, v, ``ranges`` and ``ts``. Inputs may be non-contiguous
    views (e.g. slices of a permuted qkv projection): the kernels read them through their strides.

    Args:
        q: queries ``(B, H, Tq, D)``; D one of 16, 32, 64, 128; fp32, fp16 or bf16.
        k: keys ``(B, Hk, Tk, D)``, same dtype and device as ``q``; ``Hk`` divides ``H`` (grouped-query
            attention: query head ``h`` reads key/value head ``h // (H // Hk)``, in the kernels' pointer math).
        v: values ``(B, Hk, Tk, D)``.
        ranges: MultiMax ``ranges``, ``(2,)`` (first order) or ``(4,)`` (second order); None for
            plain softmax attention. See :func:`mmlight.reweighting.multimax.multimax_sigma`.
        ts: MultiMax ``ts``, same shape as ``ranges``; None together with ``ranges``.
        scale: score scale, ``D ** -0.5`` by default.
        causal: query ``i`` sees keys up to position ``Tk - Tq + i`` (bottom-right aligned, as
            :func:`mmlight.nn.attention.causal_mask`).
        key_padding: optional bool ``(B, Tk)``, True = keep the key.

    Returns:
        ``(B, H, Tq, D)`` in q's dtype, contiguous or (``OUTPUT_IN_CALLER_LAYOUT``) a view of a
        ``(B, Tq, H, D)``-contiguous tensor (accumulated in fp32; on the GPU, fp32 inputs go through
        TF32 tensor-core matmuls, see ``FP32_DOT_PRECISION``). A query that sees no key gets 0,
        and zero gradients.

    Raises:
        ValueError: for unsupported shapes, head dims, dtypes, devices or parameter shapes.
    """
    _check_inputs(q, k, v, ranges, ts, key_padding)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return _attention(q, k, v, ranges, ts, scale, bool(causal), key_padding)
