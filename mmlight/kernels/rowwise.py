"""Row-wise fused MultiMax: ``softmax(sigma(scale * x))`` over the last dimension, masked, in Triton.

Forward reads the scores once and writes the weights once, and saves only the scores and two fp32
values per row: the maximum ``m`` of sigma and the sum ``l`` of ``exp(sigma - m)``. Backward
recomputes the weights from them as ``exp(sigma - m) / l``, the very operations of the forward pass.
(A single log-sum-exp ``m + log l`` would be one value fewer, but its fp32 rounding grows with
``|m|``, which MultiMax's sigma makes large: ``exp(s - lse)`` then errs by a whole row's factor, and
the parameter gradients, sums of many such terms, lose two orders of magnitude of accuracy.)
Backward therefore reads the scores and the
upstream gradient and writes the input gradient: three tensors, the minimum. The gradients of the
8 MultiMax parameters are reduced in fp32 inside each program and written as one partial row per
program; the host sums the partials in a fixed order, so they are deterministic (no atomics).

Two shapes of program:

* short rows (up to ``MAX_SINGLE_BLOCK`` columns, e.g. attention at N = 197): a tile of several rows
  stays in registers, read once;
* long rows (an LM's 267,744-word vocabulary): one row per program, with an online max/sum loop
  over column blocks, reading the row twice in each pass.

Semantics are those of :class:`mmlight.reweighting.Reweighting`: masked positions and ``-inf``
scores get weight 0, a fully masked row gives zeros and zero gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmlight.kernels.runtime import TRITON_DTYPES
from mmlight.kernels.sigma import (
    NUM_SIGMA_PARAMS,
    load_sigma_params,
    pack_param_partials,
    pack_sigma_params,
    sigma_derivative,
    sigma_forward,
    sigma_param_partials,
    store_param_partials,
    sum_param_partials,
)
from mmlight.kernels.tiles import device_capability, measured

#: Longest row kept in registers by one program; longer rows take the online multi-block loop.
#: 4096 fp32 values over 8 warps are 16 per thread, which the order-2 backward (scores, sigma,
#: weights, gradient and the parameter terms per value) holds without spilling on sm_80 and sm_90
#: (``benchmarks/compile_check.py``); wider single blocks spill.
MAX_SINGLE_BLOCK = 4096
#: Column block of the multi-block loop.
LONG_ROW_BLOCK = 4096
#: Elements per program a short-row tile aims for (several rows per program when rows are short).
SHORT_TILE_ELEMENTS = 4096
SUPPORTED_DTYPES = TRITON_DTYPES  # one list for the kernels and the backend choice
#: Short rows, forward: a grid of at most ``PERSISTENT_PROGRAMS_PER_SM`` programs per SM, each looping
#: over tiles of rows, instead of one program per tile. (A loop in the order-2 backward spills on
#: sm_80 and sm_90, ``benchmarks/compile_check.py``: it keeps one tile per program.) A switch for
#: benchmarks/gpu_run.py until a GPU measurement decides.
PERSISTENT_ROWS = False
PERSISTENT_PROGRAMS_PER_SM = 4
#: The grid of the persistent loop on the CPU (the interpreter), small so that tests loop.
PERSISTENT_PROGRAMS_OFFLINE = 2


@triton.jit
def _load_tile(x_ptr, mask_ptr, rows, cols, M, N, stride_x, stride_mask, scale,
               r0, r1, r2, r3, t0, t1, t2, t3, ORDER: tl.constexpr, HAS_MASK: tl.constexpr):
    """Load a ``(R, C)`` tile of scores and return ``(u, s, keep)``: ``u = scale * x`` (0 where
    masked), ``s = sigma(u)`` (-inf where masked) and the boolean keep tile."""
    inside = (rows < M) & (cols < N)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32)
    keep = inside & (x != float("-inf"))
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + rows * stride_mask + cols, mask=inside, other=0) != 0)
    # sigma(-inf) = -inf + t * inf is NaN: modulate a finite stand-in and mask afterwards.
    u = tl.where(keep, x, 0.0) * scale
    s = tl.where(keep, sigma_forward(u, r0, r1, r2, r3, t0, t1, t2, t3, ORDER), float("-inf"))
    return u, s, keep


@triton.jit
def _probabilities(s, row_max, row_sum):
    """``softmax(s)`` of a (R, C) tile from its rows' max and sum of ``exp(s - max)``: the forward
    and the backward pass share these operations, so the backward sees the forward's weights."""
    return tl.exp(s - row_max[:, None]) / row_sum[:, None]


@triton.jit
def _forward_short_rows(x_ptr, mask_ptr, y_ptr, max_ptr, sum_ptr, params_ptr, M, N, stride_x, stride_mask, stride_y,
                        scale, ORDER: tl.constexpr, HAS_MASK: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # tiles of ROWS rows, one per program or (PERSISTENT_ROWS) strided over a smaller grid
    r0, r1, r2, r3, t0, t1, t2, t3 = load_sigma_params(params_ptr)
    cols = tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
    for tile in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)[:, None]  # (ROWS, 1)
        _, s, _ = _load_tile(x_ptr, mask_ptr, rows, cols, M, N, stride_x, stride_mask, scale,
                             r0, r1, r2, r3, t0, t1, t2, t3, ORDER, HAS_MASK)
        row_max = tl.max(s, axis=1)  # (ROWS,)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # fully masked row: avoid -inf - -inf
        total = tl.sum(tl.exp(s - row_max[:, None]), axis=1)  # masked entries: exp(-inf) = 0
        total = tl.where(total == 0.0, 1.0, total)  # fully masked row: 0 / 1 = 0
        y = _probabilities(s, row_max, total)
        tl.store(y_ptr + rows * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=(rows < M) & (cols < N))
        tl.store(max_ptr + rows, row_max[:, None], mask=rows < M)
        tl.store(sum_ptr + rows, total[:, None], mask=rows < M)


@triton.jit
def _forward_long_rows(x_ptr, mask_ptr, y_ptr, max_ptr, sum_ptr, params_ptr, M, N, stride_x, stride_mask, stride_y,
                       scale, ORDER: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    r0, r1, r2, r3, t0, t1, t2, t3 = load_sigma_params(params_ptr)
    row = tl.program_id(0).to(tl.int64)
    rows = tl.full((1, 1), 0, tl.int64) + row  # (1, 1)
    running_max = tl.full((1,), float("-inf"), tl.float32)
    running_sum = tl.zeros((1,), tl.float32)
    for start in range(0, N, BLOCK_N):  # pass 1: online max and sum of exp
        cols = start + tl.arange(0, BLOCK_N)[None, :]
        _, s, _ = _load_tile(x_ptr, mask_ptr, rows, cols, M, N, stride_x, stride_mask, scale,
                             r0, r1, r2, r3, t0, t1, t2, t3, ORDER, HAS_MASK)
        new_max = tl.maximum(running_max, tl.max(s, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe_max) + tl.sum(tl.exp(s - safe_max[:, None]), axis=1)
        running_max = new_max
    row_max = tl.where(running_max == float("-inf"), 0.0, running_max)
    total = tl.where(running_sum == 0.0, 1.0, running_sum)  # fully masked row: 0 / 1 = 0
    for start in range(0, N, BLOCK_N):  # pass 2: write the weights
        cols = start + tl.arange(0, BLOCK_N)[None, :]
        _, s, _ = _load_tile(x_ptr, mask_ptr, rows, cols, M, N, stride_x, stride_mask, scale,
                             r0, r1, r2, r3, t0, t1, t2, t3, ORDER, HAS_MASK)
        y = _probabilities(s, row_max, total)
        tl.store(y_ptr + rows * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
    tl.store(max_ptr + rows, row_max[:, None])
    tl.store(sum_ptr + rows, total[:, None])


@triton.jit
def _backward_tile(u, s, dy, row_max, row_sum, dot, scale, r0, r1, r2, r3, t0, t1, t2, t3, ORDER: tl.constexpr):
    """Input gradient of a tile and its 8 parameter partials, given the row sums ``dot = sum(dy * p)``."""
    p = _probabilities(s, row_max, row_sum)
    g = p * (dy - dot[:, None])  # gradient wrt sigma(u); 0 where masked since p = 0 there
    dx = g * sigma_derivative(u, r0, r1, r2, r3, t0, t1, t2, t3, ORDER) * scale
    partials = sigma_param_partials(u, g, r0, r1, r2, r3, t0, t1, t2, t3, ORDER, False)
    return dx, partials


@triton.jit
def _backward_short_rows(x_ptr, mask_ptr, dy_ptr, dx_ptr, max_ptr, sum_ptr, params_ptr, partials_ptr, M, N,
                         stride_x, stride_mask, stride_dy, stride_dx, scale,
                         ORDER: tl.constexpr, HAS_MASK: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    r0, r1, r2, r3, t0, t1, t2, t3 = load_sigma_params(params_ptr)
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)[:, None]  # (ROWS, 1)
    cols = tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
    inside = (rows < M) & (cols < N)
    u, s, _ = _load_tile(x_ptr, mask_ptr, rows, cols, M, N, stride_x, stride_mask, scale,
                         r0, r1, r2, r3, t0, t1, t2, t3, ORDER, HAS_MASK)
    row_ids = pid * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    row_max = tl.load(max_ptr + row_ids, mask=row_ids < M, other=0.0)
    row_sum = tl.load(sum_ptr + row_ids, mask=row_ids < M, other=1.0)
    dy = tl.load(dy_ptr + rows * stride_dy + cols, mask=inside, other=0.0).to(tl.float32)
    dot = tl.sum(dy * _probabilities(s, row_max, row_sum), axis=1)
    dx, partials = _backward_tile(u, s, dy, row_max, row_sum, dot, scale, r0, r1, r2, r3, t0, t1, t2, t3, ORDER)
    tl.store(dx_ptr + rows * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)
    dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3 = partials
    store_param_partials(partials_ptr + pid * 8, dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3)


@triton.jit
def _backward_long_rows(x_ptr, mask_ptr, dy_ptr, dx_ptr, max_ptr, sum_ptr, params_ptr, partials_ptr, M, N,
                        stride_x, stride_mask, stride_dy, stride_dx, scale,
                        ORDER: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    r0, r1, r2, r3, t0, t1, t2, t3 = load_sigma_params(params_ptr)
    row = tl.program_id(0).to(tl.int64)
    rows = tl.full((1, 1), 0, tl.int64) + row  # (1, 1)
    row_max = tl.load(max_ptr + row + tl.zeros((1,), tl.int64))  # (1,)
    row_sum = tl.load(sum_ptr + row + tl.zeros((1,), tl.int64))  # (1,)
    dot = tl.zeros((1,), tl.float32)
    for start in range(0, N, BLOCK_N):  # pass 1: sum(dy * p) over the row
        cols = start + tl.arange(0, BLOCK_N)[None, :]
        _, s, _ = _load_tile(x_ptr, mask_ptr, rows, cols, M, N, stride_x, stride_mask, scale,
                             r0, r1, r2, r3, t0, t1, t2, t3, ORDER, HAS_MASK)
        dy = tl.load(dy_ptr + rows * stride_dy + cols, mask=cols < N, other=0.0).to(tl.float32)
        dot += tl.sum(dy * _probabilities(s, row_max, row_sum), axis=1)
    acc = tl.zeros((8,), tl.float32)
    for start in range(0, N, BLOCK_N):  # pass 2: input gradient and parameter partials
        cols = start + tl.arange(0, BLOCK_N)[None, :]
        u, s, _ = _load_tile(x_ptr, mask_ptr, rows, cols, M, N, stride_x, stride_mask, scale,
                             r0, r1, r2, r3, t0, t1, t2, t3, ORDER, HAS_MASK)
        dy = tl.load(dy_ptr + rows * stride_dy + cols, mask=cols < N, other=0.0).to(tl.float32)
        dx, partials = _backward_tile(u, s, dy, row_max, row_sum, dot, scale, r0, r1, r2, r3, t0, t1, t2, t3, ORDER)
        tl.store(dx_ptr + rows * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < N)
        dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3 = partials
        acc += pack_param_partials(dr0, dr1, dr2, dr3, dt0, dt1, dt2, dt3)
    tl.store(partials_ptr + row * 8 + tl.arange(0, 8), acc)


def _short_row_programs(tiles: int, device: torch.device) -> int:
    """Programs of the short-row forward: one per tile, or a persistent grid (``PERSISTENT_ROWS``)."""
    if not PERSISTENT_ROWS:
        return tiles
    if device.type == "cuda":
        cap = PERSISTENT_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        cap = PERSISTENT_PROGRAMS_OFFLINE
    return min(tiles, cap)


def _launch_config(n: int, dtype: torch.dtype = torch.float32, capability: int = 90) -> dict:
    """Block sizes and warps for rows of ``n`` columns (short: several rows per program): rows per
    program and warps from the measured table (:data:`mmlight.kernels.tiles.MEASURED`, kernel
    ``rowwise``) where it has a row for short rows, else the offline choice below.

    Args:
        n: row length.
        dtype: dtype of the scores.
        capability: compute capability, ``10 * major + minor``.
    """
    if n > MAX_SINGLE_BLOCK:
        return {"long": True, "BLOCK_N": LONG_ROW_BLOCK, "ROWS": 1, "num_warps": 8}
    block = triton.next_power_of_2(n)
    found = measured("rowwise", capability, 0, dtype, False, n)
    if found is not None:
        return {"long": False, "BLOCK_N": block, "ROWS": found.block_m, "num_warps": found.num_warps}
    rows = max(1, min(32, SHORT_TILE_ELEMENTS // block))
    num_warps = 8 if rows * block >= SHORT_TILE_ELEMENTS else 4  # at most 16 values per thread
    return {"long": False, "BLOCK_N": block, "ROWS": rows, "num_warps": num_warps}


# The kernels as operators of torch.library: torch.compile calls them as opaque operators (their
# fake functions give the output shapes), and autograd pairs the forward with the backward operator.
@torch.library.custom_op("mmlight::multimax_softmax_forward", mutates_args=())
def _softmax_forward(
    x2d: torch.Tensor, mask2d: torch.Tensor | None, params: torch.Tensor, order: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, row_max, row_sum)``: the weights ``(M, N)`` and per row the max of sigma and the sum of
    ``exp(sigma - max)``, fp32 ``(M,)``. ``mask2d`` is uint8 ``(M, N)`` or None, ``params`` the
    packed fp32 ``(8,)`` of :func:`pack_sigma_params`."""
    m, n = x2d.shape
    y = torch.empty_like(x2d)
    row_max = torch.empty(m, dtype=torch.float32, device=x2d.device)
    row_sum = torch.empty(m, dtype=torch.float32, device=x2d.device)
    cfg = _launch_config(n, x2d.dtype, device_capability(x2d.device))
    mask_arg = mask2d if mask2d is not None else x2d  # never read when HAS_MASK is False
    mask_stride = mask2d.stride(0) if mask2d is not None else 0
    common = dict(ORDER=order, HAS_MASK=mask2d is not None, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    if cfg["long"]:
        _forward_long_rows[(m,)](x2d, mask_arg, y, row_max, row_sum, params, m, n,
                                 x2d.stride(0), mask_stride, y.stride(0), scale, **common)
    else:
        _forward_short_rows[(_short_row_programs(triton.cdiv(m, cfg["ROWS"]), x2d.device),)](
            x2d, mask_arg, y, row_max, row_sum, params, m, n, x2d.stride(0), mask_stride, y.stride(0), scale,
            ROWS=cfg["ROWS"], **common)
    return y, row_max, row_sum


@_softmax_forward.register_fake
def _(x2d, mask2d, params, order, scale):
    stat = x2d.new_empty(x2d.shape[0], dtype=torch.float32)
    return torch.empty_like(x2d), stat, torch.empty_like(stat)


@torch.library.custom_op("mmlight::multimax_softmax_backward", mutates_args=())
def _softmax_backward(
    x2d: torch.Tensor, mask2d: torch.Tensor | None, dy: torch.Tensor, row_max: torch.Tensor,
    row_sum: torch.Tensor, params: torch.Tensor, order: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, d_params)``: the gradient of the scores ``(M, N)`` and of the 8 packed parameters."""
    m, n = x2d.shape
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = torch.empty_like(x2d)
    cfg = _launch_config(n, x2d.dtype, device_capability(x2d.device))
    programs = m if cfg["long"] else triton.cdiv(m, cfg["ROWS"])
    partials = torch.empty(programs, NUM_SIGMA_PARAMS, dtype=torch.float32, device=x2d.device)
    mask_arg = mask2d if mask2d is not None else x2d
    mask_stride = mask2d.stride(0) if mask2d is not None else 0
    args = (x2d, mask_arg, dy, dx, row_max, row_sum, params, partials, m, n,
            x2d.stride(0), mask_stride, dy.stride(0), dx.stride(0), scale)
    common = dict(ORDER=order, HAS_MASK=mask2d is not None, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    if cfg["long"]:
        _backward_long_rows[(programs,)](*args, **common)
    else:
        _backward_short_rows[(programs,)](*args, ROWS=cfg["ROWS"], **common)
    return dx, sum_param_partials(partials)


@_softmax_backward.register_fake
def _(x2d, mask2d, dy, row_max, row_sum, params, order, scale):
    return torch.empty_like(x2d), params.new_empty(NUM_SIGMA_PARAMS)


def _softmax_setup(ctx, inputs, output):
    x2d, mask2d, params, order, scale = inputs
    _, row_max, row_sum = output
    ctx.save_for_backward(x2d, mask2d, row_max, row_sum, params)
    ctx.order, ctx.scale = order, scale


def _softmax_grad(ctx, dy, _d_row_max, _d_row_sum):
    x2d, mask2d, row_max, row_sum, params = ctx.saved_tensors
    dx, d_params = _softmax_backward(x2d, mask2d, dy, row_max, row_sum, params, ctx.order, ctx.scale)
    return dx, None, (d_params if ctx.order else None), None, None


_softmax_forward.register_autograd(_softmax_grad, setup_context=_softmax_setup)


def check_rowwise_inputs(x: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Raise a ``ValueError``/``TypeError`` for inputs the row-wise kernel does not take."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton MultiMax kernel takes float32, bfloat16 or float16 scores, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("scores must have at least one dimension (the one normalised over)")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = keep), got dtype {mask.dtype}")
        torch.broadcast_shapes(mask.shape, x.shape)  # raises with both shapes in the message


def multimax_softmax(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    ranges: torch.Tensor | None = None,
    ts: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """``softmax(sigma(scale * x))`` over the last dimension, masked, fused in one Triton kernel.

    Args:
        x: scores ``(..., N)``, float32/bfloat16/float16, on CUDA (or on the CPU under
            ``TRITON_INTERPRET=1``). ``-inf`` entries count as masked.
        mask: optional bool mask broadcastable to ``x``, True = keep. It is expanded to one byte
            per score for the kernel; use ``-inf`` scores instead to avoid that traffic.
        ranges: MultiMax ``ranges`` ``(2,)`` or ``(4,)``; None (with ``ts`` None) for plain softmax.
        ts: MultiMax ``ts``, same shape as ``ranges``.
        scale: multiplies the scores before sigma (``1 / temperature`` for softmax).

    Returns:
        Weights shaped and typed like ``x``; masked entries and fully masked rows are 0.
    """
    check_rowwise_inputs(x, mask)
    if (ranges is None) != (ts is None):
        raise ValueError("pass both ranges and ts (MultiMax) or neither (plain softmax)")
    shape = x.shape
    if x.numel() == 0:
        return x * 0.0  # empty, but still part of the autograd graph
    x2d = x.reshape(-1, shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    mask2d = None
    if mask is not None:
        # bool -> uint8 is a free reinterpretation; the expand materialises one byte per score.
        mask2d = mask.expand(shape).reshape(-1, shape[-1]).contiguous().view(torch.uint8)
    params, order = pack_sigma_params(ranges, ts, x2d.device)
    y, _, _ = _softmax_forward(x2d, mask2d, params, order, float(scale))
    return y.reshape(shape)
