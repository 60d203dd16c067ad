"""What every reweighting module shares (reweighting/base.py, fused.py): the monitored parameters, the
query-scale default, the readable reprs, and the glue between a function and its fused kernels (the
kernels themselves are tested under the Triton interpreter in tests/kernels/)."""

import math

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


def test_multimax_init_is_torchs_truncated_normal_within_two_std_and_can_be_frozen():
    torch.manual_seed(7)
    module = build("multimax", order=2, init_std=0.05)
    torch.manual_seed(7)
    want = [nn.init.trunc_normal_(torch.empty(4), std=0.05, a=-0.1, b=0.1) for _ in range(2)]
    assert torch.equal(module.ranges.data, want[0]) and torch.equal(module.ts.data, want[1])
    frozen = build("multimax", order=1, learnable=False)
    assert not frozen.ranges.requires_grad and not frozen.ts.requires_grad


def test_multimax_init_stays_within_two_std_with_the_truncated_spread():
    """Over 4,000 draws per parameter (1,000 modules of order 2, seed 0), every value lies in
    [-2 std, 2 std], both ends are reached within 0.2 std, and the sample std is the truncated
    normal's, std * sqrt(1 - 4 phi(2) / (2 Phi(2) - 1)) = 0.8796 std, within 0.03 std (its standard
    error here is about 0.01 std). torch draws 4 values without ever leaving +-2 std, so the
    seeded comparison above cannot tell the bounds apart."""
    std = 0.05
    torch.manual_seed(0)
    modules = [build("multimax", order=2, init_std=std) for _ in range(1000)]
    phi2 = math.exp(-2.0) / math.sqrt(2 * math.pi)
    truncated_std = std * math.sqrt(1 - 4 * phi2 / math.erf(2 / math.sqrt(2)))
    for name in ("ranges", "ts"):
        values = torch.cat([getattr(m, name).detach() for m in modules]).double()
        assert values.min() >= -2 * std and values.max() <= 2 * std, name
        assert values.min() < -1.8 * std and values.max() > 1.8 * std, name
        assert abs(values.std().item() - truncated_std) < 0.03 * std, (name, values.std().item(), truncated_std)


def test_fused_ops_carry_the_functions_parameters():
    multimax = build("multimax", order=2, terms="low")
    ops = multimax.fused()
    assert ops.scale == 1.0 and ops.ranges is multimax.ranges
    assert torch.equal(ops.ts, multimax.active_ts()) and ops.ts[1].item() == 0.0
    softmax = Softmax(temperature=4.0)
    assert (softmax.fused().scale, softmax.fused().ranges, softmax.fused().ts) == (0.25, None, None)
    assert Softmax(temperature=4.0, learnable=True).fused() is None  # a learnt temperature has no kernel
    with pytest.raises(ValueError, match=r"^softmax temperature must be positive, got 0.0$"):
        Softmax(temperature=0.0)


def test_alpha_entmax_arguments_defaults_and_dtype():
    import inspect

    import entmax

    from mmlight.reweighting.alpha_entmax import MIN_ALPHA_GAP

    assert build("alpha_entmax").n_iter == inspect.signature(entmax.entmax_bisect).parameters["n_iter"].default
    build("alpha_entmax", init=1 + MIN_ALPHA_GAP)  # the lowest start allowed
    for init in (1 + MIN_ALPHA_GAP / 2, 2.0):
        with pytest.raises(
            ValueError, match=rf"^alpha_entmax init must lie in \[{1 + MIN_ALPHA_GAP}, 2\), got {init}$"
        ):
            build("alpha_entmax", init=init)
    with pytest.raises(ValueError, match=r"^alpha_entmax needs num_heads >= 1, got 0$"):
        build("alpha_entmax", num_heads=0)
    module = build("alpha_entmax", init=1.3, n_iter=3, backend="reference")
    x = torch.randn(2, 7, dtype=torch.float64)
    want = entmax.entmax_bisect(x, torch.tensor(1.3, dtype=torch.float64), dim=-1, n_iter=3)
    torch.testing.assert_close(module.double()(x), want)  # few iterations: the count reaches the bisection
    assert build("alpha_entmax", backend="reference")(torch.randn(2, 7).bfloat16()).dtype == torch.bfloat16


def test_ssmax_query_scale_is_s_log_n_in_float64():
    module = build("ssmax", num_heads=1, init=0.5).double()
    n = torch.tensor([1, 2, 7, 1000]).view(4, 1)
    want = 0.5 * torch.log(n.double())  # (4, 1)
    got = module.query_scale(n)
    torch.testing.assert_close(got, want.expand_as(got), rtol=1e-14, atol=0)
    assert got[..., 0, 0].abs().max() == 0  # one key: log 1 = 0
    with pytest.raises(ValueError, match=r"^ssmax needs num_heads >= 1, got 0$"):
        build("ssmax", num_heads=0)


def test_stickbreaking_names_scores_without_a_query_axis_and_runs_on_the_inputs_device():
    module = build("stickbreaking", backend="reference")
    with pytest.raises(ValueError, match=r"got \(5,\)$"):
        module(torch.randn(5))
    out = module(torch.randn(2, 3, 4, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 3, 4)


def test_resolve_backend_for_every_request():
    """``auto`` picks the kernel for a CUDA tensor of a supported dtype when there is one (a stand-in
    tensor here: no GPU needed), the reference otherwise; explicit names pass through or are refused
    with the reason."""
    from types import SimpleNamespace

    from mmlight.reweighting.backend import resolve_backend

    cuda = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device="cuda:0")
    cpu = torch.ones(2)
    assert resolve_backend("auto", cuda, True, "f") == "triton"
    assert resolve_backend("auto", cuda, False, "f") == "reference"
    assert resolve_backend("auto", SimpleNamespace(is_cuda=True, dtype=torch.float64), True, "f") == "reference"
    assert resolve_backend("auto", cpu, True, "f") == "reference"
    assert resolve_backend("reference", cuda, True, "f") == "reference"
    assert resolve_backend("compile", cuda, True, "f") == "compile"
    assert resolve_backend("triton", cuda, True, "f") == "triton"
    with pytest.raises(ValueError, match=r"^Sparse has no Triton kernel; use backend 'reference' or 'compile'$"):
        resolve_backend("triton", cuda, False, "Sparse")
    with pytest.raises(ValueError, match=r"^backend 'triton' takes \['torch.float32', .*got torch.float64$"):
        resolve_backend("triton", SimpleNamespace(is_cuda=True, dtype=torch.float64, device="cuda:0"), True, "f")


def test_a_function_without_kernels_names_itself_when_its_kernel_backend_is_asked_for():
    with pytest.raises(ValueError, match=r"^Sparsemax has no Triton kernel"):
        build("sparsemax", backend="triton")(torch.randn(2, 5))


def test_the_compile_backend_compiles_the_reference_once_per_module(monkeypatch):
    compiled = []

    def spy(fn):
        compiled.append(fn)
        return fn

    monkeypatch.setattr(torch, "compile", spy)
    module = build("entmax15", backend="compile")
    scores, mask = torch.randn(2, 6), torch.tensor([[True] * 6, [True, True, False, True, False, True]])
    first, second = module(scores, mask), module(scores)
    assert len(compiled) == 1 and compiled[0] == module.reference  # cached on the module
    torch.testing.assert_close(first, module.reference(scores, mask), rtol=0, atol=0)
    torch.testing.assert_close(second, module.reference(scores), rtol=0, atol=0)
    assert first[1, 2] == 0 and first[1, 4] == 0


def test_a_mask_that_is_not_bool_is_refused_by_its_dtype():
    with pytest.raises(TypeError, match=r"^mask must be a bool tensor \(True = keep\), got dtype torch.int64$"):
        Softmax()(torch.randn(2, 3), torch.ones(2, 3, dtype=torch.long))


def test_ev_softmax_against_its_definition_in_training_and_evaluation():
    """w_i ∝ (1[x_i >= mean of the kept x] + eps·training) · exp(x_i) (Chen et al., 2021); a row with one
    kept negative score keeps it (its own mean)."""
    module = build("evsoftmax", eps=1e-3, backend="reference").double()
    x = torch.tensor([[-2.0, 0.5, 1.0, -1.0], [-3.0, 5.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    for training in (True, False):
        module.train(training)
        got = module(x, mask)
        for row in range(2):
            kept = x[row][mask[row]]
            weight = (kept >= kept.mean()).double() + (1e-3 if training else 0.0)
            want = weight * kept.exp() / (weight * kept.exp()).sum()
            torch.testing.assert_close(got[row][mask[row]], want, rtol=1e-12, atol=0)
    assert got[1, 0] == 1.0


def test_softmax_by_default_is_plain_softmax():
    x = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(Softmax(backend="reference").double()(x), torch.softmax(x, dim=-1), rtol=1e-12, atol=0)


def test_argument_errors_name_the_value_and_the_choices(monkeypatch):
    from mmlight.reweighting import backend

    monkeypatch.setattr(backend, "triton_interpreting", lambda: False)
    choices = r"\['auto', 'reference', 'compile', 'triton'\]"
    with pytest.raises(ValueError, match=rf"^unknown backend 'fast'; choose one of {choices}$"):
        backend.check_backend("fast")
    with pytest.raises(
        ValueError,
        match=r"^backend 'triton' needs CUDA tensors \(or TRITON_INTERPRET=1 on the CPU\), got a tensor on cpu$",
    ):
        backend.resolve_backend("triton", torch.ones(2), True, "f")
    with pytest.raises(
        ValueError,
        match=r"^reweighting 'softmax' got unknown option\(s\) \['tempreature'\]; "
        r"it accepts \['temperature', 'learnable', 'backend'\]$",
    ):
        build("softmax", tempreature=2.0)


def test_per_head_values_broadcast_against_unbatched_scores():
    """Scores without a batch axis, ``(nh, Tq, Tk)``, take a per-head parameter (and so does ssmax)."""
    from mmlight.reweighting.base import per_head

    values, scores = torch.tensor([1.0, 2.0]), torch.zeros(2, 3, 4)
    assert torch.equal(
        per_head(values, scores) * torch.ones_like(scores), torch.tensor([1.0, 2.0]).view(2, 1, 1).expand(2, 3, 4)
    )
    with pytest.raises(
        ValueError, match=r"^a parameter with 2 heads needs scores \(\.\.\., 2, Tq, Tk\), got shape \(3, 4\)$"
    ):
        per_head(values, torch.zeros(3, 4))
    module = build("ssmax", num_heads=2)
    with torch.no_grad():
        module.s.copy_(torch.tensor([0.5, 2.0]))
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    want = torch.softmax(
        torch.tensor([0.5, 2.0], dtype=torch.float64).view(2, 1, 1) * torch.log(torch.tensor(5.0)) * x, -1
    )
    torch.testing.assert_close(module(x), want)


@pytest.mark.parametrize("name", ["softmax", "sparsemax", "evsoftmax"])
def test_masked_keys_get_nothing_even_when_every_kept_score_is_far_below_zero(name):
    """Kept scores of about -6,000 with masked keys beside them: the masked keys sit ``MASKED_GAP``
    below the row's maximum, not below zero, so the kept keys still share all the mass."""
    scores = torch.tensor([[-6000.0, -6001.0, 3.0, -6000.5]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True]])
    kept = scores[mask]
    want = {
        "softmax": torch.softmax(kept, -1),
        # sparsemax of (0, -1, -0.5): threshold -0.75, so (0.75, 0, 0.25)
        "sparsemax": torch.tensor([0.75, 0.0, 0.25], dtype=torch.float64),
        # ev-softmax (evaluation): the mean is -0.5, so softmax over 0 and -0.5 only
        "evsoftmax": torch.tensor([1.0, 0.0, math.exp(-0.5)], dtype=torch.float64) / (1 + math.exp(-0.5)),
    }[name]
    got = build(name).eval()(scores, mask)
    assert got[0, 2] == 0
    torch.testing.assert_close(got[mask], want)


def test_default_top_k_keeps_eight_and_default_ev_softmax_trains_with_eps_one_in_a_million():
    scores = torch.arange(10, dtype=torch.float64).flip(0).unsqueeze(0)  # 9, 8, ..., 0
    top = build("topk")(scores)
    torch.testing.assert_close(top[0, :8], torch.softmax(scores[0, :8], -1))
    assert torch.equal(top[0, 8:], torch.zeros(2, dtype=torch.float64))
    # ev-softmax in training: the entries below the mean (4.5) keep eps * exp(x) of unnormalised weight
    weight = torch.exp(scores[0]) * ((scores[0] >= 4.5).double() + 1e-6)
    torch.testing.assert_close(build("evsoftmax").train()(scores)[0], weight / weight.sum(), rtol=1e-12, atol=0)
