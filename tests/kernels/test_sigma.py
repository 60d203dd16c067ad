"""The sigma helpers every MultiMax kernel inlines (``mmlight/kernels/sigma.py``), each on its own: the
forward map, its derivative and the 8 parameter partials (summed over a tile and per row, packed and
stored), against float64 autograd of the reference definition :func:`mmlight.reweighting.multimax.multimax_sigma`.

Without a GPU the probe kernel runs under ``TRITON_INTERPRET=1`` (set in ``tests/conftest.py``), fp32.
"""

import pytest
import torch
import triton
import triton.language as tl

from mmlight.kernels import sigma
from mmlight.reweighting.multimax import multimax_sigma

# Breakpoints inside the scores' range and slopes of distinct sizes: every term of sigma and of its
# partials is non-zero on the tile, and a term swapped with another changes the result.
RANGES = {1: [-0.5, 0.6], 2: [-0.5, 0.6, -1.0, 1.2]}
TS = {1: [0.3, 0.25], 2: [0.3, 0.25, 0.1, 0.05]}
ROWS, COLS = 4, 16


@triton.jit
def _probe(
    x_ptr,
    g_ptr,
    params_ptr,
    y_ptr,
    d_ptr,
    tile_ptr,
    rows_ptr,
    packed_ptr,
    R: tl.constexpr,
    C: tl.constexpr,
    ORDER: tl.constexpr,
):
    """sigma, its derivative, the tile's partials (two half tiles added to the zero sums, stored one by
    one), the per-row partials ``(8, R)`` and the packed partials ``(8,)`` of one ``(R, C)`` tile."""
    row = tl.arange(0, R)[:, None]
    half = tl.arange(0, C // 2)[None, :]
    r0, r1, r2, r3, t0, t1, t2, t3 = sigma.load_sigma_params(params_ptr)
    sums = sigma.zero_param_sums(R, False)
    per_row = sigma.zero_param_sums(R, True)
    for part in tl.static_range(2):
        at = row * C + part * (C // 2) + half
        x = tl.load(x_ptr + at)
        g = tl.load(g_ptr + at)
        tl.store(y_ptr + at, sigma.sigma_forward(x, r0, r1, r2, r3, t0, t1, t2, t3, ORDER))
        tl.store(d_ptr + at, sigma.sigma_derivative(x, r0, r1, r2, r3, t0, t1, t2, t3, ORDER))
        sums = sigma.add_param_partials(*sums, x, g, r0, r1, r2, r3, t0, t1, t2, t3, ORDER, False)
        per_row = sigma.add_param_partials(*per_row, x, g, r0, r1, r2, r3, t0, t1, t2, t3, ORDER, True)
    sigma.store_param_partials(tile_ptr, *sums)
    rows = tl.arange(0, R)
    tl.store(rows_ptr + 0 * R + rows, per_row[0])
    tl.store(rows_ptr + 1 * R + rows, per_row[1])
    tl.store(rows_ptr + 2 * R + rows, per_row[2])
    tl.store(rows_ptr + 3 * R + rows, per_row[3])
    tl.store(rows_ptr + 4 * R + rows, per_row[4])
    tl.store(rows_ptr + 5 * R + rows, per_row[5])
    tl.store(rows_ptr + 6 * R + rows, per_row[6])
    tl.store(rows_ptr + 7 * R + rows, per_row[7])
    tl.store(packed_ptr + tl.arange(0, 8), sigma.pack_param_partials(*sums))


def probe(x: torch.Tensor, g: torch.Tensor, order: int) -> dict[str, torch.Tensor]:
    ranges = torch.tensor(RANGES[order]) if order else None
    ts = torch.tensor(TS[order]) if order else None
    params, packed_order = sigma.pack_sigma_params(ranges, ts, x.device)
    assert packed_order == order
    out = {name: torch.empty_like(x) for name in ("y", "d")}
    out |= {"tile": torch.empty(8), "rows": torch.empty(8, ROWS), "packed": torch.empty(8)}
    _probe[(1,)](x, g, params, out["y"], out["d"], out["tile"], out["rows"], out["packed"], ROWS, COLS, order)
    return out


def reference(x: torch.Tensor, g: torch.Tensor, order: int) -> dict[str, torch.Tensor]:
    """float64 autograd: sigma, d sigma/dx (sigma is elementwise) and sum(g * d sigma/d theta), per row too,
    as ``(r0..r3, t0..t3)`` with zeros for a first order's unused terms."""
    x = x.double().requires_grad_()
    if not order:
        return {"y": x.detach(), "d": torch.ones_like(x), "tile": torch.zeros(8), "rows": torch.zeros(8, ROWS)}
    n = len(RANGES[order])
    # the fp32 values the kernel holds, in float64 (a breakpoint then equals an fp32 score exactly)
    ranges = torch.tensor(RANGES[order]).double().requires_grad_()
    ts = torch.tensor(TS[order]).double().requires_grad_()
    y = multimax_sigma(x, ranges, ts)
    (d,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    rows = torch.zeros(8, ROWS, dtype=torch.float64)
    for i in range(ROWS):
        dr, dt = torch.autograd.grad((g[i].double() * y[i]).sum(), (ranges, ts), retain_graph=True)
        rows[:n, i], rows[4 : 4 + n, i] = dr, dt
    return {"y": y.detach(), "d": d, "tile": rows.sum(dim=1), "rows": rows}


@pytest.mark.parametrize("order", [0, 1, 2])
def test_sigma_its_derivative_and_parameter_partials_match_float64_autograd(order):
    gen = torch.Generator().manual_seed(order)
    x = torch.randn(ROWS, COLS, generator=gen) * 1.5  # beyond every breakpoint on both sides
    g = torch.randn(ROWS, COLS, generator=gen)
    got, want = probe(x, g, order), reference(x, g, order)
    for name in ("y", "d", "tile", "rows"):
        torch.testing.assert_close(got[name].double(), want[name].double(), rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(got["packed"], got["tile"])  # the same 8 values, in the packed parameters' order
    if order:  # the tile's sums are the per-row partials summed (what a PER_ROW loop reduces once at its end)
        torch.testing.assert_close(got["rows"].sum(dim=1), got["tile"], rtol=1e-6, atol=1e-6)


def test_the_derivative_takes_relus_derivative_at_a_breakpoint_as_zero():
    """At x exactly on a breakpoint the derivative leaves that term out, as ``torch.relu``'s backward does."""
    order = 2
    x = torch.zeros(ROWS, COLS)
    x[0, :4] = torch.tensor(RANGES[order])  # each breakpoint once; the rest between them
    got, want = probe(x, torch.ones(ROWS, COLS), order), reference(x, torch.ones(ROWS, COLS), order)
    torch.testing.assert_close(got["d"].double(), want["d"], rtol=0, atol=1e-7)
    # r0, r1: on their own breakpoint, inside the second order's; r2 = -1 < r0 and r3 = 1.2 > r1 take the
    # first order's slope only (1 - t0, 1 + t1); 0 lies between every pair of breakpoints
    assert got["d"][0, :4].tolist() == pytest.approx([1.0, 1.0, 0.7, 1.25]) and torch.all(got["d"][1:] == 1.0)


def test_pack_sigma_params_pads_each_half_and_carries_the_gradient_back():
    assert [v.tolist() for v in sigma.pack_sigma_params(None, None, torch.device("cpu"))[:1]] == [[0.0] * 8]
    ranges = torch.tensor([-0.5, 0.6], dtype=torch.float64, requires_grad=True)
    ts = torch.tensor([0.3, 0.25], dtype=torch.float64, requires_grad=True)
    params, order = sigma.pack_sigma_params(ranges, ts, torch.device("cpu"))
    assert order == 1 and params.dtype == torch.float32
    assert params.tolist() == pytest.approx([-0.5, 0.6, 0, 0, 0.3, 0.25, 0, 0])
    # the kernels return the gradient of the 8 packed values; autograd splits it back into both halves
    params.backward(torch.arange(1.0, 9.0))
    assert ranges.grad.tolist() == [1.0, 2.0] and ts.grad.tolist() == [5.0, 6.0]
    assert ranges.grad.dtype == torch.float64
    four = torch.tensor([1.0, 2.0, 3.0, 4.0])
    params, order = sigma.pack_sigma_params(four, -four, torch.device("cpu"))
    assert order == 2 and params.tolist() == [1.0, 2.0, 3.0, 4.0, -1.0, -2.0, -3.0, -4.0]


def test_sum_param_partials_sums_the_programs():
    partials = torch.arange(24.0).reshape(3, 8)
    assert sigma.sum_param_partials(partials).tolist() == (partials[0] + partials[1] + partials[2]).tolist()
