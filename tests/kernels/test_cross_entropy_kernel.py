"""Fused MultiMax cross-entropy kernel against an independent float64 torch reference.

Runs on CPU under Triton's interpreter when there is no GPU (see tests/conftest.py), so the shapes
are tiny; ``MAX_BLOCK_V`` is lowered where the multi-block row loop must run.
"""

import pytest
import torch
import torch.nn.functional as F

from mmlight.kernels import cross_entropy as ce
from mmlight.kernels.cross_entropy import multimax_cross_entropy
from mmlight.reweighting.multimax import multimax_sigma

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IGNORE = -100
# Large enough that sigma bends visibly over logits ~ N(0, 2^2).
PARAMS = {
    0: (None, None),
    1: ((-0.5, 0.5), (0.3, 0.2)),
    2: ((-0.5, 0.5, -1.0, 1.0), (0.3, 0.2, 0.1, 0.05)),
}


def make_inputs(T, V, order, dtype=torch.float32, ignored=(1, 4), row_pad=0):
    """Logits (a leaf, optionally a row-strided view), targets with some ignored rows, and parameters."""
    base = torch.randn(T, V + row_pad, device=DEVICE) * 2.0
    logits = base[:, row_pad:].to(dtype) if row_pad else base.to(dtype)
    logits.requires_grad_()
    target = torch.randint(0, V, (T,), device=DEVICE)
    for i in ignored:
        if i < T:
            target[i] = IGNORE
    r, t = PARAMS[order]
    ranges = None if r is None else torch.tensor(r, device=DEVICE, requires_grad=True)
    ts = None if t is None else torch.tensor(t, device=DEVICE, requires_grad=True)
    return logits, target, ranges, ts


def reference(logits, target, ranges, ts, grad_scale=1.0, **kwargs):
    """Loss and gradients (logits, ranges, ts) of the eager definition, in float64 with autograd."""
    z = logits.detach().double().requires_grad_()
    r = None if ranges is None else ranges.detach().double().requires_grad_()
    t = None if ts is None else ts.detach().double().requires_grad_()
    s = z if r is None else multimax_sigma(z, r, t)
    loss = F.cross_entropy(s, target, **kwargs)
    (grad_scale * loss).backward()
    return loss.detach(), z.grad, None if r is None else r.grad, None if t is None else t.grad


def kernel(logits, target, ranges, ts, grad_scale=1.0, **kwargs):
    """Loss and gradients of the kernel, the same way."""
    for x in (logits, ranges, ts):
        if x is not None and x.grad is not None:
            x.grad = None
    loss = multimax_cross_entropy(logits, target, ranges, ts, **kwargs)
    (grad_scale * loss).backward()
    return loss.detach(), logits.grad, None if ranges is None else ranges.grad, None if ts is None else ts.grad


def assert_close(got, want, rtol=1e-5, atol=1e-6):
    assert (got is None) == (want is None)
    if got is not None:
        torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


def assert_matches(got, want, rtol=1e-5, atol=1e-6, param_rtol=1e-5, param_atol=1e-5):
    assert_close(got[0], want[0], rtol, atol)
    assert_close(got[1], want[1], rtol, atol)
    assert_close(got[2], want[2], param_rtol, param_atol)
    assert_close(got[3], want[3], param_rtol, param_atol)


@pytest.fixture
def small_block(monkeypatch):
    """Force several column blocks per row at test sizes."""
    monkeypatch.setattr(ce, "MAX_BLOCK_V", 256)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("order", [0, 1, 2])
def test_matches_float64_reference(order, label_smoothing, reduction):
    # V = 197: not a power of two, one masked partial block of 256.
    logits, target, ranges, ts = make_inputs(6, 197, order)
    kw = {"label_smoothing": label_smoothing, "ignore_index": IGNORE, "reduction": reduction}
    want = reference(logits, target, ranges, ts, **kw)
    got = kernel(logits, target, ranges, ts, **kw)
    assert got[0].dtype == torch.float32
    assert_matches(got, want)
    assert torch.all(got[1][1] == 0) and torch.all(got[1][4] == 0)  # ignored rows


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_parameters_with_sigma_of_zero_not_zero(reduction):
    """The kernel loads 0 for the lanes past V in the last block and for the target of an ignored
    row. With the test parameters above sigma(0) = 0, which hides both stand-ins; here every range
    lies above 0, so sigma(0) = 0.3 * 0.2 + 0.1 * 0.5**2 = 0.085, and neither stand-in may reach
    the label-smoothing sum or the loss of an ignored row."""
    logits, target, _, _ = make_inputs(6, 197, 2)  # rows 1 and 4 ignored; V = 197 in a block of 256
    ranges = torch.tensor((0.2, 0.9, 0.5, 1.5), device=DEVICE, requires_grad=True)
    ts = torch.tensor((0.3, 0.2, 0.1, 0.05), device=DEVICE, requires_grad=True)
    assert multimax_sigma(torch.zeros(1, device=DEVICE), ranges, ts).item() == pytest.approx(0.085, rel=1e-6)
    kw = {"label_smoothing": 0.1, "ignore_index": IGNORE, "reduction": reduction}
    assert_matches(kernel(logits, target, ranges, ts, **kw), reference(logits, target, ranges, ts, **kw))


@pytest.mark.parametrize("order", [0, 2])
def test_multi_block_row_loop_with_row_stride(small_block, order):
    # V = 1000 with blocks of 256: three full blocks and a partial one; rows 1,000 + 7 apart in memory.
    logits, target, ranges, ts = make_inputs(4, 1000, order, row_pad=7)
    assert logits.stride(0) == 1007
    kw = {"label_smoothing": 0.1, "ignore_index": IGNORE}
    assert_matches(kernel(logits, target, ranges, ts, **kw), reference(logits, target, ranges, ts, **kw))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_plain_cross_entropy_matches_torch(reduction):
    # Directly against F.cross_entropy in fp32, with a non-default ignore_index that is a valid class.
    logits, target, _, _ = make_inputs(6, 197, 0, ignored=())
    target[2] = 5
    kw = {"label_smoothing": 0.1, "ignore_index": 5, "reduction": reduction}
    z = logits.detach().clone().requires_grad_()
    want = F.cross_entropy(z, target, **kw)
    want.backward()
    got = multimax_cross_entropy(logits, target, **kw)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.grad, z.grad, rtol=1e-5, atol=1e-7)
    assert torch.all(logits.grad[2] == 0)


def test_all_targets_ignored_gives_zero_not_nan():
    logits, target, ranges, ts = make_inputs(3, 197, 2, ignored=(0, 1, 2))
    want = reference(logits, target, ranges, ts, ignore_index=IGNORE)
    assert torch.isnan(want[0])  # torch's "mean" over zero tokens: the documented difference
    loss, d_logits, d_ranges, d_ts = kernel(logits, target, ranges, ts, ignore_index=IGNORE)
    assert loss.item() == 0.0
    for g in (d_logits, d_ranges, d_ts):
        assert torch.all(g == 0)
    # With "sum" torch agrees: 0 and zero gradients.
    assert_matches(
        kernel(logits, target, ranges, ts, reduction="sum"), reference(logits, target, ranges, ts, reduction="sum")
    )


def test_empty_batch():
    logits, target, ranges, ts = make_inputs(0, 197, 2)
    loss, d_logits, d_ranges, d_ts = kernel(logits, target, ranges, ts)
    assert loss.item() == 0.0 and d_logits.shape == (0, 197)
    assert torch.all(d_ranges == 0) and torch.all(d_ts == 0)
    # "sum" over nothing is 0 in torch too.
    assert_matches(
        kernel(logits, target, ranges, ts, reduction="sum"), reference(logits, target, ranges, ts, reduction="sum")
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(dtype):
    # The reference sees the same rounded logits; only the stored gradient is rounded to dtype.
    logits, target, ranges, ts = make_inputs(6, 197, 2, dtype=dtype)
    kw = {"label_smoothing": 0.1}
    got = kernel(logits, target, ranges, ts, **kw)
    want = reference(logits, target, ranges, ts, **kw)
    assert got[1].dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert_matches(got, want, rtol=tol, atol=1e-5, param_rtol=1e-4, param_atol=1e-5)


@pytest.mark.parametrize("in_backward", [True, False], ids=["gradient_in_backward", "gradient_in_forward"])
def test_inplace_grad_writes_into_logits_storage(monkeypatch, in_backward):
    monkeypatch.setattr(ce, "GRADIENT_IN_BACKWARD", in_backward)
    leaf, target, ranges, ts = make_inputs(6, 197, 2)
    want = reference(leaf, target, ranges, ts, grad_scale=3.0, label_smoothing=0.1)
    logits = leaf * 1.0  # an intermediate, as the LM head's output would be
    before = logits.detach().clone()
    loss = multimax_cross_entropy(logits, target, ranges, ts, label_smoothing=0.1, inplace_grad=True)
    if in_backward:  # the forward only reads the logits
        assert torch.equal(logits.detach(), before)
    else:  # the forward already overwrote the logits with the (unscaled) gradient
        torch.testing.assert_close(logits.detach().double(), want[1] / 3.0, rtol=1e-5, atol=1e-6)
    (3.0 * loss).backward(retain_graph=True)
    assert_matches((loss.detach(), leaf.grad, ranges.grad, ts.grad), want)
    torch.testing.assert_close(logits.detach().double(), want[1], rtol=1e-5, atol=1e-6)  # the scaled gradient
    with pytest.raises(RuntimeError, match="twice"):  # the logits are gone: no second backward
        loss.backward()
    with pytest.raises(ValueError, match="leaf"):
        multimax_cross_entropy(leaf, target, ranges, ts, inplace_grad=True)


def test_param_grads_are_bitwise_deterministic(small_block):
    logits, target, ranges, ts = make_inputs(8, 600, 2)
    first = kernel(logits, target, ranges, ts, label_smoothing=0.1)
    first = [g.clone() for g in first]
    second = kernel(logits, target, ranges, ts, label_smoothing=0.1)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert_matches(first, reference(logits, target, ranges, ts, label_smoothing=0.1))


@pytest.mark.parametrize("order", [0, 2])
def test_non_unit_grad_output(order):
    logits, target, ranges, ts = make_inputs(6, 197, order)
    kw = {"label_smoothing": 0.1, "reduction": "sum"}
    assert_matches(
        kernel(logits, target, ranges, ts, grad_scale=2.0, **kw),
        reference(logits, target, ranges, ts, grad_scale=2.0, **kw),
    )


def test_param_grads_without_logit_grads_and_inference():
    logits, target, ranges, ts = make_inputs(6, 197, 2)
    logits.requires_grad_(False)
    want = reference(logits, target, ranges, ts, label_smoothing=0.1)
    loss = multimax_cross_entropy(logits, target, ranges, ts, label_smoothing=0.1)
    loss.backward()
    assert_matches((loss.detach(), None, ranges.grad, ts.grad), (want[0], None, want[2], want[3]))
    with torch.no_grad():
        torch.testing.assert_close(
            multimax_cross_entropy(logits, target, ranges, ts, label_smoothing=0.1).double(),
            want[0],
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize("in_backward", [True, False], ids=["gradient_in_backward", "gradient_in_forward"])
def test_a_second_backward_through_the_same_graph(monkeypatch, in_backward):
    """With the gradient in the backward, a second backward recomputes it from the saved logits and
    accumulates it again; computed in the forward, it is scaled in place once, and a second raises."""
    monkeypatch.setattr(ce, "GRADIENT_IN_BACKWARD", in_backward)
    logits, target, _, _ = make_inputs(3, 197, 0)
    loss = multimax_cross_entropy(logits, target)
    loss.backward(retain_graph=True)
    want = reference(logits, target, None, None)[1]
    torch.testing.assert_close(logits.grad.double(), want, rtol=1e-5, atol=1e-7)
    if in_backward:
        loss.backward()
        torch.testing.assert_close(logits.grad.double(), 2 * want, rtol=1e-5, atol=1e-7)
    else:
        with pytest.raises(RuntimeError, match="twice"):
            loss.backward()


def _bad(name):
    T, V = 4, 197
    logits = torch.randn(T, V, device=DEVICE)
    target = torch.randint(0, V, (T,), device=DEVICE)
    r2, t2 = torch.zeros(2, device=DEVICE), torch.zeros(2, device=DEVICE)
    cases = {
        "logits 1-D": lambda: multimax_cross_entropy(logits[0], target),
        "logits int": lambda: multimax_cross_entropy(logits.long(), target),
        "last dim strided": lambda: multimax_cross_entropy(logits.t().contiguous().t(), target),
        "target shape": lambda: multimax_cross_entropy(logits, target[:3]),
        "target dtype": lambda: multimax_cross_entropy(logits, target.int()),
        "reduction none": lambda: multimax_cross_entropy(logits, target, reduction="none"),
        "smoothing > 1": lambda: multimax_cross_entropy(logits, target, label_smoothing=1.5),
        "smoothing < 0": lambda: multimax_cross_entropy(logits, target, label_smoothing=-0.1),
        "ranges only": lambda: multimax_cross_entropy(logits, target, r2, None),
        "ranges shape": lambda: multimax_cross_entropy(logits, target, torch.zeros(3), torch.zeros(3)),
        "ts shape": lambda: multimax_cross_entropy(logits, target, torch.zeros(4), t2),
        "target too big": lambda: multimax_cross_entropy(logits, target.index_fill(0, torch.tensor([2]), V)),
        "target negative": lambda: multimax_cross_entropy(logits, target.index_fill(0, torch.tensor([1]), -7)),
    }
    return cases[name]


@pytest.mark.parametrize(
    "name, match",
    [
        ("logits 1-D", "2-D"),
        ("logits int", "dtype"),
        ("last dim strided", "contiguous"),
        ("target shape", "shape"),
        ("target dtype", "int64"),
        ("reduction none", "reduction"),
        ("smoothing > 1", "label_smoothing"),
        ("smoothing < 0", "label_smoothing"),
        ("ranges only", "together"),
        ("ranges shape", r"\(2,\) or \(4,\)"),
        ("ts shape", r"\(2,\) or \(4,\)"),
        ("target too big", "target value 197 "),
        ("target negative", "target value -7 "),
    ],
)
def test_bad_inputs_raise(name, match):
    with pytest.raises(ValueError, match=match):
        _bad(name)()


def test_float64_parameters_get_float64_grads():
    logits, target, ranges, ts = make_inputs(4, 197, 1)
    ranges = ranges.detach().double().requires_grad_()
    ts = ts.detach().double().requires_grad_()
    got = kernel(logits, target, ranges, ts, label_smoothing=0.1)
    assert got[2].dtype == torch.float64 and got[3].dtype == torch.float64
    assert_matches(got, reference(logits, target, ranges, ts, label_smoothing=0.1))


@pytest.fixture(params=[True, False], ids=["gradient_in_backward", "gradient_in_forward"])
def gradient_in_backward(monkeypatch, request):
    """Both places of the gradient pass (GRADIENT_IN_BACKWARD): the backward (shipped), and the forward
    followed by a pass that scales it."""
    monkeypatch.setattr(ce, "GRADIENT_IN_BACKWARD", request.param)


@pytest.mark.parametrize(
    "order, reduction, grad_scale", [(0, "mean", 1.0), (1, "mean", 1.0), (2, "mean", 1.0), (2, "sum", 2.5)]
)
def test_gradient_in_backward_matches_reference(gradient_in_backward, small_block, order, reduction, grad_scale):
    """Several column blocks, ignored rows, label smoothing and an upstream gradient read on the device."""
    logits, target, ranges, ts = make_inputs(6, 600, order)
    kw = {"label_smoothing": 0.1, "ignore_index": IGNORE, "reduction": reduction, "grad_scale": grad_scale}
    got = kernel(logits, target, ranges, ts, **kw)
    assert_matches(got, reference(logits, target, ranges, ts, **kw))
    assert torch.all(got[1][1] == 0) and torch.all(got[1][4] == 0)  # ignored rows


def test_gradient_in_backward_of_the_parameters_alone(gradient_in_backward):
    """Frozen logits: the backward pass reads them and writes nothing into them."""
    logits, target, ranges, ts = make_inputs(6, 197, 2)
    logits.requires_grad_(False)
    before = logits.clone()
    want = reference(logits, target, ranges, ts, label_smoothing=0.1)
    multimax_cross_entropy(logits, target, ranges, ts, label_smoothing=0.1).backward()
    assert torch.equal(logits, before)
    assert_matches((None, None, ranges.grad, ts.grad), (None, None, want[2], want[3]))


def test_gradient_in_backward_in_place_and_deterministic(gradient_in_backward):
    leaf, target, ranges, ts = make_inputs(6, 197, 2)
    want = reference(leaf, target, ranges, ts, grad_scale=3.0, label_smoothing=0.1)
    logits = leaf * 1.0
    loss = multimax_cross_entropy(logits, target, ranges, ts, label_smoothing=0.1, inplace_grad=True)
    (3.0 * loss).backward(retain_graph=True)
    # written in the backward, into the logits' own storage, already scaled
    torch.testing.assert_close(logits.detach().double(), want[1], rtol=1e-5, atol=1e-6)
    assert_matches((loss.detach(), leaf.grad, ranges.grad, ts.grad), want)
    first = (ranges.grad.clone(), ts.grad.clone())
    ranges.grad = ts.grad = None
    multimax_cross_entropy(leaf * 1.0, target, ranges, ts, label_smoothing=0.1).mul(3.0).backward()
    assert torch.equal(first[0], ranges.grad) and torch.equal(first[1], ts.grad)
