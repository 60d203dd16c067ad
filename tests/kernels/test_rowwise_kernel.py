"""The row-wise Triton kernel against the eager reference (float64 autograd) and a NumPy formula.

Without a GPU these run under ``TRITON_INTERPRET=1`` (set in ``tests/conftest.py``), fp32 arithmetic.
"""

import numpy as np
import pytest
import torch

from mmlight.kernels import rowwise
from mmlight.kernels.rowwise import multimax_softmax
from mmlight.reweighting import MultiMax, Softmax, build
from mmlight.reweighting.backend import resolve_backend
from tests.helpers.reweighting_references import apply_masked
from tests.helpers.reweighting_references import softmax as np_softmax

# Values that bend sigma visibly (the 0.02 init would hide mistakes in the derivative terms).
RANGES = {1: [-0.5, 0.6], 2: [-0.5, 0.6, -1.0, 1.2]}
TS = {1: [0.3, 0.25], 2: [0.3, 0.25, 0.1, 0.05]}


def multimax(order: int, dtype=torch.float64, backend="reference") -> MultiMax:
    module = MultiMax(order=order, backend=backend).to(dtype)
    with torch.no_grad():
        module.ranges.copy_(torch.tensor(RANGES[order]))
        module.ts.copy_(torch.tensor(TS[order]))
    return module


def scores_and_mask(rows=(3, 5), n=197, seed=0):
    """Scores ``(*rows, n)`` with a key mask broadcast over the middle dim, one fully masked row
    group and one ``-inf`` score."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, n, generator=g, dtype=torch.float64) * 2
    x[0, 0, 3] = float("-inf")
    mask = torch.rand(rows[0], 1, n, generator=g) > 0.3
    mask[1] = False  # every row of batch 1 fully masked
    return x, mask


def run_kernel(x, mask, order, dy, scale=1.0):
    """Kernel output and gradients (x, ranges, ts): in fp32, or in ``x``'s dtype if it is fp16 or bf16."""
    ranges = torch.tensor(RANGES[order], requires_grad=True) if order else None
    ts = torch.tensor(TS[order], requires_grad=True) if order else None
    half = x.dtype in (torch.float16, torch.bfloat16)
    xk = (x.detach().clone() if half else x.float()).requires_grad_()
    y = multimax_softmax(xk, mask, ranges, ts, scale=scale)
    y.backward(dy.to(xk.dtype))
    return y, xk.grad, (ranges.grad if order else None), (ts.grad if order else None)


def run_reference(x, mask, order, dy, scale=1.0):
    module = multimax(order) if order else Softmax().double()
    xr = x.clone().requires_grad_()
    y = module.reference(xr * scale, mask)  # autograd carries the factor scale into xr.grad
    y.backward(dy)
    grads = (module.ranges.grad, module.ts.grad) if order else (None, None)
    return (y, xr.grad, *grads)


def assert_matches_reference(x, mask, order, atol=2e-6, scale=1.0):
    dy = torch.randn_like(x)
    got = run_kernel(x, mask, order, dy, scale)
    want = run_reference(x, mask, order, dy, scale)
    for name, g, w in zip(("y", "dx", "d_ranges", "d_ts"), got, want):
        if w is None:
            continue
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("order", [0, 1, 2])
def test_short_rows_match_reference(order):
    """N = 197 (not a power of two), several rows per program, broadcast mask, masked rows, -inf."""
    x, mask = scores_and_mask()
    assert_matches_reference(x, mask, order)


def test_long_rows_take_the_multi_block_loop(monkeypatch):
    """Rows longer than one block: the online max/sum loop (shrunk here so the interpreter is quick)."""
    monkeypatch.setattr(rowwise, "MAX_SINGLE_BLOCK", 64)
    monkeypatch.setattr(rowwise, "LONG_ROW_BLOCK", 32)
    assert rowwise._launch_config(100)["long"]
    x, mask = scores_and_mask(rows=(3, 2), n=100)
    assert_matches_reference(x, mask, order=2)


def test_partial_tile_of_rows():
    """A row count that does not fill the last multi-row tile."""
    cfg = rowwise._launch_config(40)
    assert cfg["ROWS"] > 1
    x = torch.randn(cfg["ROWS"] + 3, 40, dtype=torch.float64)
    assert_matches_reference(x, None, order=2)


def test_forward_matches_numpy_formula():
    """Independent of the package: sigma from Eq. 6 in NumPy, softmax over kept entries per row."""
    x, mask = scores_and_mask(rows=(3, 4), n=37)
    r, t = RANGES[2], TS[2]

    def row_fn(z):
        sigma = (
            z
            + t[0] * np.maximum(r[0] - z, 0)
            + t[1] * np.maximum(z - r[1], 0)
            + t[2] * np.maximum(r[2] - z, 0) ** 2
            + t[3] * np.maximum(z - r[3], 0) ** 2
        )
        return np_softmax(sigma)

    want = apply_masked(row_fn, x.numpy(), mask.numpy())
    got = multimax_softmax(x.float(), mask, torch.tensor(r), torch.tensor(t))
    np.testing.assert_allclose(got.numpy(), want, atol=1e-6)


def test_softmax_temperature_is_a_scale():
    x = torch.randn(4, 50)
    got = multimax_softmax(x, scale=0.5)
    torch.testing.assert_close(got, torch.softmax(x * 0.5, dim=-1))


@pytest.mark.parametrize("order", [0, 2])
def test_a_scale_reaches_the_gradients(order):
    """``scale`` (a fixed softmax temperature's 1/T on the Triton backend) in the backward pass: the
    input gradient carries the factor ``scale``, the parameter gradients see the scaled scores."""
    x, mask = scores_and_mask(rows=(2, 3), n=37)
    assert_matches_reference(x, mask, order, scale=0.5)


@pytest.mark.parametrize("transposed", ["scores", "upstream gradient"])
def test_column_major_scores_and_upstream_gradients(transposed):
    """Scores or the gradient of ``y`` as transposed views (last stride not 1), as ``x.t()`` or the
    backward of ``y.t() @ v`` hands them over. The kernels read a row through one stride, so they
    must see the values, not the layout."""
    x = torch.randn(6, 37, dtype=torch.float64) * 2
    dy = torch.randn(6, 37, dtype=torch.float64)
    if transposed == "scores":
        x = x.t().contiguous().t()
    else:
        dy = dy.t().contiguous().t()
    assert (x if transposed == "scores" else dy).float().stride() == (1, 6)
    got = run_kernel(x, None, 2, dy)
    want = run_reference(x, None, 2, dy)
    for name, g, w in zip(("y", "dx", "d_ranges", "d_ts"), got, want):
        torch.testing.assert_close(g.double(), w, atol=2e-6, rtol=1e-4, msg=name)


def test_long_row_kernels_write_only_inside_their_rows():
    """The column loop's last block runs past column N. Its stores must stop there: on a GPU a store
    past the end lands in the next row, which another program writes at the same time. Output and
    input gradient are written into the first N columns of wider buffers whose other columns must
    keep their NaN."""
    rows, n, block = 3, 100, 32  # the last block covers columns 96..127
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, n, generator=gen) * 2
    dy = torch.randn(rows, n, generator=gen)
    ranges, ts = torch.tensor(RANGES[2]), torch.tensor(TS[2])
    params, order = rowwise.pack_sigma_params(ranges, ts, x.device)
    y_buffer = torch.full((rows, n + block), float("nan"))
    dx_buffer = torch.full((rows, n + block), float("nan"))
    y, dx = y_buffer[:, :n], dx_buffer[:, :n]
    row_max, row_sum = torch.empty(rows), torch.empty(rows)
    partials = torch.empty(rows, rowwise.NUM_SIGMA_PARAMS)
    options = dict(ORDER=order, HAS_MASK=False, BLOCK_N=block)
    rowwise._forward_long_rows[(rows,)](
        x, x, y, row_max, row_sum, params, rows, n, x.stride(0), 0, y.stride(0), 1.0, **options
    )
    rowwise._backward_long_rows[(rows,)](
        x,
        x,
        dy,
        dx,
        row_max,
        row_sum,
        params,
        partials,
        rows,
        n,
        x.stride(0),
        0,
        dy.stride(0),
        dx.stride(0),
        1.0,
        **options,
    )
    assert torch.isnan(y_buffer[:, n:]).all() and torch.isnan(dx_buffer[:, n:]).all()
    want = run_reference(x.double(), None, 2, dy.double())
    torch.testing.assert_close(y.double(), want[0], atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(dx.double(), want[1], atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    x, mask = scores_and_mask(rows=(2, 3), n=197)
    module = multimax(2, dtype=torch.float32)
    # Same (rounded) inputs for both, so only the kernel's own error is left: fp32 arithmetic and
    # one rounding of the output to the half type.
    want = module.reference(x.to(dtype).float(), mask)
    got = multimax_softmax(x.to(dtype), mask, module.ranges, module.ts)
    assert got.dtype == dtype
    rtol = 8e-3 if dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients(dtype):
    """Backward from half-precision scores: the saved row statistics stay fp32, so the recomputed
    weights are the forward's. Against float64 on the same rounded scores and upstream gradient, the
    input gradient errs by its one rounding to ``dtype`` and the fp32 parameter gradients by 3e-7 to
    9e-7 (relative, 2-norm, one draw each); row statistics saved in fp16 or bf16 gave 3e-4 to 9e-2."""
    x, mask = scores_and_mask(rows=(2, 3), n=197)
    x = x.to(dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = run_kernel(x, mask, 2, dy)
    want = run_reference(x.double(), mask, 2, dy.double())
    assert got[1].dtype == dtype
    rtol = 8e-3 if dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(got[1].double(), want[1], rtol=rtol, atol=1e-6, msg="dx")
    for name, g, w in zip(("d_ranges", "d_ts"), got[2:], want[2:]):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-6, msg=name)


def test_parameter_gradients_are_deterministic():
    x, mask = scores_and_mask()
    dy = torch.randn_like(x)
    first = run_kernel(x, mask, 2, dy)
    second = run_kernel(x, mask, 2, dy)
    assert torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])


def test_empty_batch():
    module = multimax(2, torch.float32, backend="triton")
    x = torch.randn(0, 3, 197, requires_grad=True)
    y = module(x)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape


def assert_backend_matches_reference(backend: str) -> None:
    """MultiMax on ``backend`` equals the reference module through the module API, grads included."""
    x, mask = scores_and_mask(rows=(2, 3), n=29)
    x = x.float()
    ref, other = multimax(2, torch.float32, "reference"), multimax(2, torch.float32, backend)
    y_ref, y_other = ref(x, mask), other(x, mask)
    torch.testing.assert_close(y_other, y_ref)
    y_ref.pow(2).sum().backward()
    y_other.pow(2).sum().backward()
    torch.testing.assert_close(other.ts.grad, ref.ts.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(other.ranges.grad, ref.ranges.grad, atol=1e-6, rtol=1e-4)


def test_module_backends_agree():
    assert_backend_matches_reference("triton")


def test_backend_errors_are_clear(monkeypatch):
    with pytest.raises(ValueError, match="no Triton kernel"):
        build("sparsemax", backend="triton")(torch.randn(2, 5))
    with pytest.raises(ValueError, match="no Triton kernel"):
        build("softmax", learnable=True, backend="triton")(torch.randn(2, 5))
    with pytest.raises(ValueError, match="float64"):
        multimax(2, torch.float64, "triton")(torch.randn(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown backend"):
        build("multimax", backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        resolve_backend("triton", torch.randn(2), True, "MultiMax")


def test_auto_is_reference_on_cpu_tensors():
    assert resolve_backend("auto", torch.randn(2), True, "MultiMax") == "reference"


@pytest.mark.slow
def test_compile_backend_matches_reference():
    """torch.compile of the reference (slow: a first compile takes tens of seconds on the CPU)."""
    assert_backend_matches_reference("compile")


@pytest.mark.parametrize("order", [0, 2])
def test_persistent_rows_match_reference(monkeypatch, order):
    """PERSISTENT_ROWS: two forward programs loop over the tiles of rows."""
    monkeypatch.setattr(rowwise, "PERSISTENT_ROWS", True)
    x, mask = scores_and_mask(rows=(4, 20), n=40)  # 80 rows of 40, 3 tiles of 32: program 0 takes two
    assert rowwise._short_row_programs(rowwise.triton.cdiv(80, rowwise._launch_config(40)["ROWS"]), x.device) == 2
    assert_matches_reference(x, mask, order)
