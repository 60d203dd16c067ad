"""``auto`` never breaks a run: a Triton kernel that fails is replaced by ``compile``.

Without a GPU ``auto`` never picks the kernels, so these tests make it pick them (``resolve_backend``
patched where it is called) and make the kernels fail; ``torch.compile`` is replaced by the identity
so that the fallback path runs at once on the CPU (what is checked is that it is taken).
"""

import importlib
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmlight.reweighting import MultiMax, backend, base, fused, multimax
from mmlight.reweighting.backend import run_fused

attention_module = importlib.import_module("mmlight.nn.attention")  # the package re-exports the function


@pytest.fixture(autouse=True)
def fresh_failures(monkeypatch):
    monkeypatch.setattr(backend, "FAILED_KERNELS", {})
    monkeypatch.setattr(backend, "_PROBED", set())


def broken(*args):
    raise RuntimeError("PTXASError: ptxas ran out of registers")


def test_auto_falls_back_once_with_one_warning():
    calls = []

    def kernel(x):
        calls.append(x)
        return broken()

    x = torch.ones(3)
    with pytest.warns(RuntimeWarning, match=r"MultiMax row-wise \(torch.float32, <=4\).*PTXASError"):
        assert torch.equal(run_fused("auto", "MultiMax row-wise", kernel, lambda x: x * 2, x), x * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert torch.equal(run_fused("auto", "MultiMax row-wise", kernel, lambda x: x * 3, x), x * 3)
    assert len(calls) == 1  # not tried again
    assert list(backend.FAILED_KERNELS) == ["MultiMax row-wise (torch.float32, <=4)"]


def test_explicit_triton_raises():
    with pytest.raises(RuntimeError, match="out of registers"):
        run_fused("triton", "MultiMax row-wise", broken, lambda x: x, torch.ones(3))


def test_out_of_memory_is_not_swallowed():
    def oom(x):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        run_fused("auto", "MultiMax row-wise", oom, lambda x: x, torch.ones(3))


class _FailingBackward(torch.autograd.Function):
    """Identity forward; a backward that fails as a kernel compiled at its first launch would."""

    @staticmethod
    def forward(ctx, x, weight):
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("triton.runtime.errors.OutOfResources: shared memory")


def test_a_backward_that_cannot_run_is_caught_before_the_forward_commits():
    weight = torch.tensor(2.0, requires_grad=True)
    x = torch.ones(4, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="OutOfResources"):
        y = run_fused("auto", "kernel", lambda x: _FailingBackward.apply(x, weight), lambda x: x * weight, x)
    y.sum().backward()  # the fallback's graph: works
    assert torch.equal(x.grad, torch.full((4,), 2.0)) and weight.grad == 4.0  # the trial left no gradient


def test_a_working_kernel_runs_its_backward_once_and_is_used():
    x = torch.ones(4, requires_grad=True)
    calls = []

    def kernel(x):
        calls.append(1)
        return x * 5

    for _ in range(3):
        y = run_fused("auto", "kernel", kernel, broken, x)
    assert torch.equal(y, x * 5) and len(calls) == 4  # one trial with backward, then one per call
    assert x.grad is None


@pytest.fixture
def triton_chosen_and_broken(monkeypatch):
    """``auto`` resolves to ``triton`` at every call site, and every kernel raises."""
    choose_triton = lambda requested, tensor, has_kernel, owner: (  # noqa: E731
        "triton" if has_kernel and requested in ("auto", "triton") else requested
    )
    for module in (attention_module, base, multimax):
        monkeypatch.setattr(module, "resolve_backend", choose_triton)
    monkeypatch.setattr(fused.SigmaKernels, "rowwise", lambda self, *a: broken())
    monkeypatch.setattr(fused.SigmaKernels, "attention", lambda self, *a: broken())
    monkeypatch.setattr("mmlight.kernels.multimax_cross_entropy", broken)
    monkeypatch.setattr(torch, "compile", lambda fn: fn)
    multimax._compiled_cross_entropy.cache_clear()
    yield
    multimax._compiled_cross_entropy.cache_clear()


def make_multimax(backend_name):
    module = MultiMax(order=2, backend=backend_name)
    with torch.no_grad():
        module.ranges.copy_(torch.tensor([-0.5, 0.5, -1.0, 1.0]))
        module.ts.copy_(torch.tensor([0.3, 0.2, 0.1, 0.05]))
    return module


def test_every_call_site_falls_back_under_auto(triton_chosen_and_broken):
    module = make_multimax("auto")
    scores = torch.randn(2, 3, 5, 7)
    q, k, v = torch.randn(3, 2, 2, 5, 16).unbind(0)
    logits, target = torch.randn(4, 9), torch.tensor([0, 3, 8, 1])
    mask = torch.rand(2, 3, 5, 7, generator=torch.Generator().manual_seed(0)) > 0.3
    with pytest.warns(RuntimeWarning) as record:
        weights = module(scores)
        compiled = getattr(module, "_compiled_reference", None)  # set by the compile backend only
        masked = module(scores, mask)  # the fallback gets the mask too
        out = attention_module.attention(q, k, v, module, is_causal=True)
        loss = module.cross_entropy(logits, target)
    named = " ".join(str(w.message) for w in record)
    for key in (
        "MultiMax row-wise (torch.float32, <=8)",
        "MultiMax attention (torch.float32, <=16)",
        "MultiMax cross-entropy (torch.float32, <=16)",
    ):
        assert f"the Triton kernel for {key} failed" in named
    assert compiled == module.reference  # the row-wise fallback is the compile backend
    torch.testing.assert_close(weights, module.reference(scores))
    torch.testing.assert_close(masked, module.reference(scores, mask))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(out, module.reference(q @ k.transpose(-2, -1) * 16**-0.5, causal) @ v)
    torch.testing.assert_close(loss, F.cross_entropy(module.modulate(logits), target))


def test_every_call_site_raises_with_explicit_triton(triton_chosen_and_broken):
    module = make_multimax("triton")
    q, k, v = torch.randn(3, 2, 2, 5, 16).unbind(0)
    with pytest.raises(RuntimeError, match="out of registers"):
        module(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="out of registers"):
        attention_module.attention(q, k, v, module)
    with pytest.raises(RuntimeError, match="out of registers"):
        module.cross_entropy(torch.randn(4, 9), torch.tensor([0, 3, 8, 1]))


def test_the_failure_is_recorded_as_its_type_and_first_line_and_the_warning_points_at_the_caller():
    def two_lines(x):
        raise ValueError("  first line\nsecond line  ")

    def silent(x):
        raise RuntimeError("   ")

    with pytest.warns(RuntimeWarning) as caught:
        run_fused("auto", "a", two_lines, lambda x: x, torch.ones(2))
        run_fused("auto", "b", silent, lambda x: x, torch.ones(2))
    assert backend.FAILED_KERNELS == {
        "a (torch.float32, <=2)": "ValueError: first line",
        "b (torch.float32, <=2)": "RuntimeError: ",
    }
    assert str(caught[0].message) == (
        "mmlight: the Triton kernel for a (torch.float32, <=2) failed on this device (ValueError: first line); "
        "backend 'auto' computes it with 'compile' from now on. Run `mmlight doctor` for details, "
        "or set backend 'triton' to get the error raised."
    )
    # stacklevel 2: the line that called run_fused (under mutation testing, mutmut's trampoline is that caller)
    assert Path(caught[0].filename).name in (Path(__file__).name, "trampoline.py")


def test_kernel_key_names_the_dtype_and_the_power_of_two_at_or_above_the_last_dim():
    """The tile sizes follow the next power of two, so failures are remembered per such bucket; inputs
    without a tensor of at least one dimension key the kernel alone."""
    key = backend.kernel_key
    assert key("k", (torch.ones(3, 1),)) == "k (torch.float32, <=1)"
    assert key("k", (torch.ones(3, 2, dtype=torch.bfloat16),)) == "k (torch.bfloat16, <=2)"
    assert [key("k", (torch.ones(n),)) for n in (3, 4, 5, 64, 65)] == [
        f"k (torch.float32, <={p})" for p in (4, 4, 8, 64, 128)
    ]
    assert key("k", (None, 0.5, torch.ones(2, 5))) == "k (torch.float32, <=8)"  # the first tensor
    assert key("k", (None, 0.5)) == "k"
    assert key("k", (torch.tensor(2.0), torch.ones(9))) == "k"  # the first tensor is a scalar


def test_the_backward_trial_takes_masks_numbers_and_unused_inputs_and_touches_no_input():
    """The trial differentiates only the floating-point inputs that require grad, through detached
    copies: an integer mask, a Python number, None and an input the kernel does not use are fine,
    and hooks on the real inputs (DDP's, a user's) do not fire."""
    x = torch.ones(4, requires_grad=True)
    unused = torch.ones(2, requires_grad=True)
    mask = torch.tensor([1, 0, 1, 1])
    hooked = []
    x.register_hook(lambda grad: hooked.append(grad))
    calls = []

    def kernel(x, unused, mask, scale, nothing):
        calls.append(1)
        return x * mask * scale

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed trial would warn
        y = run_fused("auto", "kernel", kernel, broken, x, unused, mask, 3.0, None)
    assert torch.equal(y, torch.tensor([3.0, 0.0, 3.0, 3.0])) and len(calls) == 2
    assert hooked == [] and x.grad is None and unused.grad is None
    y.sum().backward()
    assert len(hooked) == 1 and torch.equal(x.grad, torch.tensor([3.0, 0.0, 3.0, 3.0]))


def test_a_working_cross_entropy_kernel_is_the_one_used_under_auto(triton_chosen_and_broken, monkeypatch):
    """The kernel, given the module's arguments, computes the loss; nothing falls back."""
    seen = []

    def kernel(logits, target, ranges, ts, smoothing, ignore_index, reduction):
        seen.append((smoothing, ignore_index, reduction))
        return multimax.multimax_cross_entropy_reference(logits, target, ranges, ts, smoothing, ignore_index, reduction)

    monkeypatch.setattr("mmlight.kernels.multimax_cross_entropy", kernel)
    module = make_multimax("auto")
    logits, target = torch.randn(4, 9), torch.tensor([0, 3, 8, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = module.cross_entropy(logits, target, 0.1, 3, "sum")
    assert seen == [(0.1, 3, "sum")] * 2 and not backend.FAILED_KERNELS  # the backward's trial, then the call
    torch.testing.assert_close(
        loss, F.cross_entropy(module.modulate(logits), target, label_smoothing=0.1, ignore_index=3, reduction="sum")
    )


def test_inside_a_compiled_graph_only_a_kernel_that_failed_before_takes_its_fallback():
    """Traced by torch.compile (a task's ``compile`` option), ``auto`` neither probes nor catches: a kernel
    remembered as failed (for this dtype and width) computes with its fallback, every other runs fused."""
    narrow, wide = torch.randn(3, 8), torch.randn(3, 100)
    backend.FAILED_KERNELS[backend.kernel_key("k", (narrow,))] = "RuntimeError: earlier"

    def call(x):
        return run_fused("auto", "k", lambda t: t + 1, lambda t: t - 1, x)

    compiled = torch.compile(call, backend="eager")  # not fullgraph: mutation testing adds a graph break
    assert torch.equal(compiled(narrow), narrow - 1)
    assert torch.equal(compiled(wide), wide + 1)
    assert list(backend.FAILED_KERNELS) == ["k (torch.float32, <=8)"] and backend._PROBED == set()
