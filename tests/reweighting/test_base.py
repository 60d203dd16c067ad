"""What every reweighting module shares (reweighting/base.py, fused.py): the monitored parameters, the
query-scale default, the readable reprs, and the glue between a function and its fused kernels (the
kernels themselves are tested under the Triton interpreter in tests/kernels/)."""

import pytest
import torch
from torch import nn

from mmlight.reweighting import Softmax, build
from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.fused import FusedOps, SigmaKernels


class _WithAChild(Reweighting):
    """A function with a parameter of its own, a frozen one and a sub-module's."""

    def __init__(self):
        super().__init__("reference")
        self.gain = nn.Parameter(torch.tensor(2.0))
        self.frozen = nn.Parameter(torch.tensor(1.0), requires_grad=False)
        self.inner = nn.Linear(2, 2)


def test_monitored_is_the_modules_own_trainable_parameters():
    assert list(_WithAChild().monitored()) == ["gain"]


def test_softmax_monitors_its_temperature_only_when_learnable_and_says_so_in_its_repr():
    learnable = Softmax(temperature=2.0, learnable=True)
    assert list(learnable.monitored()) == ["temperature"]
    assert learnable.monitored()["temperature"].item() == pytest.approx(2.0)
    assert Softmax(temperature=0.5).monitored() == {}
    assert learnable.extra_repr() == "temperature=2, learnable=True"
    assert Softmax(temperature=0.125).extra_repr() == "temperature=0.125, learnable=False"


def test_sigmoid_repr_names_its_bias():
    assert build("sigmoid").extra_repr() == "bias=-log n"
    assert build("sigmoid", bias=-1.5).extra_repr() == "bias=-1.5"


def test_a_function_that_does_not_scale_queries_says_so():
    with pytest.raises(NotImplementedError, match=r"^Softmax does not scale queries$"):
        Softmax().query_scale(torch.ones(2, 1))


def test_fused_ops_have_no_attention_kernel_unless_they_define_one():
    assert FusedOps().attention(*torch.ones(3, 1, 1, 2, 16), 1.0, False, None) is None
    with pytest.raises(NotImplementedError):
        FusedOps().rowwise(torch.ones(2), None)


def test_sigma_kernels_pass_their_parameters_and_the_combined_scale_to_the_kernels(monkeypatch):
    """The row-wise kernel gets the scores, mask, ranges, slopes and scale; the attention kernel the
    product of the call's and the function's scale, and nothing for head sizes it lacks (checked on
    the last dim: nh = 3 is not a head size either)."""
    import mmlight.kernels
    import mmlight.kernels.attention

    seen = {}
    monkeypatch.setattr(mmlight.kernels, "multimax_softmax", lambda *a: seen.setdefault("rowwise", a))
    monkeypatch.setattr(
        mmlight.kernels.attention, "multimax_attention", lambda *a, **kw: seen.setdefault("attention", (a, kw))
    )
    ranges, ts = torch.tensor([-0.5, 0.5]), torch.tensor([0.3, 0.2])
    ops = SigmaKernels(0.5, ranges, ts)
    scores, mask = torch.randn(2, 5), torch.ones(2, 5, dtype=torch.bool)
    assert ops.rowwise(scores, mask) == (scores, mask, ranges, ts, 0.5)
    q, k, v = torch.randn(3, 2, 3, 4, 16).unbind(0)
    padding = torch.ones(2, 4, dtype=torch.bool)
    args, kwargs = ops.attention(q, k, v, 0.25, True, padding)
    assert args == (q, k, v, ranges, ts, 0.125) and kwargs == {"causal": True, "key_padding": padding}
    assert ops.attention(q[..., :8], k[..., :8], v, 0.25, False, None) is None  # no kernel for 8


def test_a_learnable_temperature_divides_the_scores_and_learns():
    module = Softmax(temperature=2.0, learnable=True, backend="reference")
    x = torch.randn(3, 6, dtype=torch.float64)
    weights = module.double()(x)
    torch.testing.assert_close(weights, torch.softmax(x / 2.0, dim=-1))
    (weights[:, 0]).sum().backward()
    assert module.log_temperature.grad is not None and module.log_temperature.grad.item() != 0.0


def test_a_name_registered_twice_is_refused_by_name():
    from mmlight.reweighting.registry import register

    with pytest.raises(ValueError, match=r"^reweighting 'softmax' is registered twice$"):
        register("softmax")(Softmax)


def test_constructor_arguments_out_of_range_are_named():
    with pytest.raises(ValueError, match=r"^sigmoid bias must be finite, got inf$"):
        build("sigmoid", bias=float("inf"))
    with pytest.raises(ValueError, match=r"^top-k needs k >= 1, got 0$"):
        build("topk", k=0)


def test_top_1_keeps_the_largest_score_alone():
    weights = build("topk", k=1, backend="reference")(torch.tensor([[0.5, 2.0, -1.0, 1.5]]))
    assert torch.equal(weights, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_ssmax_keeps_half_precision_inputs_in_their_dtype():
    """Its learnable scale is float32; the weights stay in the scores' dtype (as softmax's do)."""
    module = build("ssmax", num_heads=2, backend="reference")
    scores = torch.randn(1, 2, 3, 5).bfloat16()
    weights = module(scores)
    assert weights.dtype == torch.bfloat16
    torch.testing.assert_close(weights.float(), module(scores.float()), atol=2e-2, rtol=0)


def test_triton_runs_on_cuda_or_under_the_interpreter_only(monkeypatch):
    from mmlight.reweighting import backend

    monkeypatch.setattr(backend, "triton_interpreting", lambda: False)
    with pytest.raises(
        ValueError, match=r"needs CUDA tensors \(or TRITON_INTERPRET=1 on the CPU\), got a tensor on cpu"
    ):
        backend.resolve_backend("triton", torch.ones(2), True, "f")
    monkeypatch.setattr(backend, "triton_interpreting", lambda: True)
    assert backend.resolve_backend("triton", torch.ones(2), True, "f") == "triton"
