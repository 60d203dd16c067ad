"""Every reweighting function: the properties they all share (generic, over the whole registry),
and each built-in against an independent reference.

The generic tests are parametrised by :func:`mmlight.reweighting.available`, so a function added as
one new file in ``mmlight/reweighting/`` is covered without editing this file: it only needs a
reference test of its own (like ``test_matches_reference_with_masks`` below).
"""

import copy
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmlight import reweighting
from mmlight.reweighting.registry import _REGISTRY
from tests.helpers import reweighting_references as ref

#: Every registered function, built-ins and any added file alike.
NAMES = reweighting.available()
#: The built-ins with an independent reference in this file.
REFERENCED = ["softmax", "multimax", "sparsemax", "entmax15", "evsoftmax", "topk"]
ROOT = Path(__file__).resolve().parents[2]


def reference_fn(name, module):
    """The independent row function for ``module`` (a built reweighting)."""
    if name == "softmax":
        return lambda z: ref.softmax(z / float(module.temperature))
    if name == "multimax":
        r, t = module.ranges.detach().double().numpy(), module.ts.detach().double().numpy()

        def sigma(z):  # the official formula, written out with numpy
            out = z + t[0] * np.maximum(r[0] - z, 0) + t[1] * np.maximum(z - r[1], 0)
            if len(r) == 4:
                out = out + t[2] * np.maximum(r[2] - z, 0) ** 2 + t[3] * np.maximum(z - r[3], 0) ** 2
            return out

        return lambda z: ref.softmax(sigma(z))
    if name == "topk":
        return lambda z: ref.topk(z, module.k)
    return {"sparsemax": ref.sparsemax, "entmax15": ref.entmax15, "evsoftmax": ref.evsoftmax}[name]


def make(name):
    """A built-in with options and parameters away from the defaults, for the reference tests."""
    kwargs = {"topk": {"k": 3}, "softmax": {"temperature": 0.7}}.get(name, {})
    module = reweighting.build(name, **kwargs)
    if name == "multimax":  # move away from the near-identity init so sigma matters
        with torch.no_grad():
            module.ranges.copy_(torch.tensor([-0.5, 0.8, -1.0, 1.2]))
            module.ts.copy_(torch.tensor([-0.6, -0.3, 0.2, -0.1]))
    return module.eval()


def generic(name):
    """Any registered function with its default options, its parameters (if any) moved away from
    their initial values by fixed noise, so that parameter-dependent terms take part."""
    torch.manual_seed(0)  # the same initial parameters on every call (hypothesis calls it once per example)
    module = reweighting.build(name)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    return module.eval()


def check_row_mass(module, p, keep):
    """Weights ``p`` are non-negative, 0 outside ``keep``, and each row's sum is what the function
    declares (:attr:`~mmlight.reweighting.Reweighting.row_mass`): 1 on the simplex, within [0, 1] for
    a function that may attend to nothing, and each weight within [0, 1] when the sum is unbounded.
    A row with nothing kept sums to 0 whatever the function."""
    assert (p[~keep] == 0).all() and (p >= 0).all() and (p <= 1 + 1e-12).all()
    sums, any_kept = p.sum(-1), keep.any(-1)
    assert (sums[~any_kept] == 0).all()
    if module.row_mass == "one":
        torch.testing.assert_close(sums, any_kept.to(sums.dtype), atol=1e-9, rtol=0)
    elif module.row_mass == "at_most_one":
        assert (sums <= 1 + 1e-9).all()
    else:
        assert module.row_mass == "unbounded"


def test_registry_names():
    assert set(REFERENCED) <= set(NAMES)
    assert NAMES == sorted(_REGISTRY)


def test_build_rejects_unknown_name_and_option():
    with pytest.raises(ValueError, match="unknown reweighting 'softmx'"):
        reweighting.build("softmx")
    with pytest.raises(ValueError, match="unknown reweighting 'softmx'"):
        reweighting.ReweightingSpec("softmx")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['tempreature'\]"):
        reweighting.build("softmax", tempreature=2.0)


@pytest.mark.parametrize("name", REFERENCED)
def test_matches_reference_with_masks(name):
    module = make(name)
    scores = torch.randn(3, 4, 7, dtype=torch.float64) * 2
    mask = torch.rand(3, 1, 7) > 0.3  # broadcast over the middle dimension
    mask[0, 0, :] = False  # a fully masked row
    scores[1, 2, 3] = float("-inf")  # a -inf score acts as masked
    got = module(scores, mask).detach().numpy()
    want = ref.apply_masked(reference_fn(name, module), scores.numpy(), mask.numpy())
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert (got[0] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_masks_inf_and_fully_masked_rows(name):
    """Generic: masked and -inf positions get exactly 0, other rows sum to 1, an empty row is 0."""
    module = generic(name).double()
    scores = torch.randn(3, 4, 7, dtype=torch.float64) * 2
    mask = torch.rand(3, 1, 7) > 0.3
    mask[0] = False  # fully masked rows
    mask[1, 0, :2] = True
    scores[1, 2, 3] = float("-inf")
    scores[2, 1] = float("-inf")  # every score -inf
    p = module(scores, mask)
    keep = mask.expand_as(scores) & (scores != float("-inf"))
    check_row_mass(module, p, keep)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_simplex_monotone_and_equivariant(name, data):
    k = data.draw(st.integers(1, 12))
    values = data.draw(st.lists(st.floats(-5, 5), min_size=k, max_size=k))
    keep = data.draw(st.lists(st.booleans(), min_size=k, max_size=k))
    scores = torch.tensor(values, dtype=torch.float64)
    mask = torch.tensor(keep)
    module = generic(name).double()
    if module.causal_only:
        # weights by position (so neither monotone nor equivariant): every query of a causal square
        scores, mask = scores.expand(k, k), mask & torch.ones(k, k, dtype=torch.bool).tril()
        check_row_mass(module, module(scores, mask), mask)
        return
    p = module(scores, mask)
    check_row_mass(module, p, mask)
    # monotone: among kept entries, a larger score never gets a smaller weight
    s, w = scores[mask], p[mask]
    order = torch.argsort(s)
    assert (w[order].diff() >= -1e-12).all()
    # permutation-equivariant
    perm = torch.randperm(k)
    torch.testing.assert_close(module(scores[perm], mask[perm]), p[perm])


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_float64(name):
    """Input gradients, and those of every learnable parameter, against finite differences."""
    module = generic(name).double()
    scores = (torch.randn(2, 6, dtype=torch.float64) * 2).requires_grad_()
    mask = torch.tensor([[True, True, False, True, True, True], [True] * 6])
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    params = [p.detach().clone().requires_grad_() for n, p in module.named_parameters() if p.requires_grad]

    def fn(x, *ps):
        return torch.func.functional_call(module, dict(zip(names, ps)), (x, mask))

    assert torch.autograd.gradcheck(fn, (scores, *params))
    if name == "multimax":
        assert names == ["ranges", "ts"]


@pytest.mark.parametrize(
    "name, options",
    [("sink", {"num_heads": 2}), ("softmax", {"learnable": True, "temperature": 0.7})],
)
def test_learned_parameters_are_cast_to_the_scores_precision(name, options):
    """The weights are computed in the scores' precision: a float64 copy of a function on float32 scores
    gives the float32 function's weights, bit for bit (its parameters are exact in either; α-entmax's α is a
    sigmoid of its parameter, computed in the parameter's precision, so it is not)."""
    torch.manual_seed(0)
    module = reweighting.build(name, **options)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # away from the initial values
    scores = torch.randn(2, 2, 3, 6) * 3
    want = module(scores)
    got = copy.deepcopy(module).double()(scores)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("name", ["sparsemax", "entmax15", "alpha_entmax"])
def test_gradcheck_float64_on_4d_scores(name):
    """The entmax family's own backward passes (scores and α) reduce over the keys of ``(B, nh, Tq, Tk)``
    scores."""
    module = reweighting.build(name, num_heads=2) if name == "alpha_entmax" else reweighting.build(name)
    module = module.double()
    scores = (torch.randn(2, 2, 3, 5, dtype=torch.float64) * 2).requires_grad_()
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    params = [p.detach().clone().requires_grad_() for p in module.parameters() if p.requires_grad]
    assert len(params) == (name == "alpha_entmax")

    def fn(x, *ps):
        return torch.func.functional_call(module, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(fn, (scores, *params))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(name, dtype):
    module = generic(name)
    scores = torch.randn(4, 9) * 3
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[1] = False
    p = module(scores.to(dtype), mask)
    assert p.dtype == dtype and torch.isfinite(p).all()
    # against the fp32 computation on the same rounded scores: only the output rounding remains
    want = module(scores.to(dtype).float(), mask)
    torch.testing.assert_close(p.float(), want, rtol=8e-3 if dtype == torch.bfloat16 else 1e-3, atol=1e-6)
    assert (p[1] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_no_nan_in_grad_for_masked_and_inf_rows(name):
    module = generic(name)
    scores = torch.randn(3, 5)
    scores[0] = float("-inf")  # every score -inf
    scores[2, :2] = float("-inf")
    scores.requires_grad_()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False  # fully masked
    p = module(scores, mask)
    (p * torch.randn_like(p)).sum().backward()
    assert torch.isfinite(p).all() and (p[:2] == 0).all()
    assert torch.isfinite(scores.grad).all()
    assert all(torch.isfinite(q.grad).all() for q in module.parameters() if q.requires_grad)


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch(name):
    p = generic(name)(torch.randn(0, 4, 7), torch.ones(0, 4, 7, dtype=torch.bool))
    assert p.shape == (0, 4, 7)


def lm_fast_dev_run(tmp_path, name: str, options: str = "{}"):
    """One training and one validation step of the recall LM quick start with ``name`` in every
    attention layer, set from the command line as a user would."""
    from mmlight.lightning_cli import build_cli

    config = ROOT / "configs" / "quickstart" / "lm_softmax.yaml"
    return build_cli(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.fast_dev_run",
            "1",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "runs"),
            "--trainer.default_root_dir",
            str(tmp_path),
            "--model.init_args.model.attention.name",
            name,
            "--model.init_args.model.attention.options",
            options,
        ]
    )


@pytest.mark.parametrize("name", NAMES)
def test_fast_dev_run_of_a_model_using_it(name, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["mmlight"])
    cli = lm_fast_dev_run(tmp_path, name)
    assert cli.trainer.global_step == 1 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    layers = [site.module for site in cli.model.model.attention_sites().values()]
    assert all(type(m) is _REGISTRY[name] for m in layers)


@pytest.fixture
def cube_power():
    """A function defined and registered here, as a researcher would in a new file:
    weights proportional to ``relu(x - max + width)^3``, a sparse map with a learnable width."""

    class CubePower(reweighting.Reweighting):
        """Sparse weights ``relu(x - max + width)**3``, normalised.

        Args:
            width: how far below the maximum a score still gets weight.
            backend: see :mod:`mmlight.reweighting.backend`.
        """

        def __init__(self, width: float = 2.0, backend="auto"):
            super().__init__(backend)
            self.width = torch.nn.Parameter(torch.tensor(float(width)))

        def normalize(self, x, keep):
            w = torch.relu(x + self.width) ** 3  # x is already shifted so that the row max is 0
            return w / w.sum(-1, keepdim=True)

    reweighting.register("cube_power_test")(CubePower)
    yield CubePower
    del _REGISTRY["cube_power_test"]


def test_a_function_registered_in_one_place_runs_through_a_config(cube_power, tmp_path, monkeypatch):
    """Registering is all it takes: the config accepts the name, its option reaches the module, the
    model trains, and its output equals the formula computed here."""
    monkeypatch.setattr(sys, "argv", ["mmlight"])
    cli = lm_fast_dev_run(tmp_path, "cube_power_test", "{width: 3.0}")
    layers = [site.module for site in cli.model.model.attention_sites().values()]
    assert len(layers) == 2 and all(isinstance(m, cube_power) for m in layers)
    assert cli.trainer.global_step == 1
    module = layers[0]
    scores = torch.tensor([[0.0, -1.0, -2.5, -4.0]])
    w = torch.relu(scores + module.width.detach()) ** 3
    torch.testing.assert_close(module(scores).detach(), w / w.sum(-1, keepdim=True))
    assert module(scores)[0, 3] == 0  # 4 below the maximum with width ~3: outside the support


# ---------------------------------------------------------------------------- extreme values, against float64

#: learned parameters of the built-ins set far out: +-1e4, and values whose exp overflows fp32 (beyond ~88.7)
EXTREME_PARAMETERS = (
    [("sink", "sink_logit", value) for value in (1e4, -1e4, 200.0, -200.0)]
    + [("softmax", "log_temperature", value) for value in (1e4, -1e4, 100.0, -100.0)]
    + [("ssmax", "s", value) for value in (1e4, -1e4, 200.0)]
    + [("alpha_entmax", "alpha_logit", value) for value in (1e4, -1e4, 200.0)]
    + [("multimax", parameter, value) for parameter in ("ranges", "ts") for value in (1e4, -1e4)]
)
#: (dtype, tolerance): fp32 to a few ulps of the weights' size (1), bf16 to its 8 bits (2^-8 = 0.0039, and the
#: output's rounding); a gradient to that fraction of its natural size (below)
EXTREME_DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


def extreme_scores():
    """(2, 3, 6) fp64 scores: rows with +-1e4, with scores beyond fp32's exp range (200, 150, 100, 90), a row
    of -1e4 only, and ordinary ones; and a fixed upstream gradient."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 6, generator=g, dtype=torch.float64) * 2
    x[0, 0] = torch.tensor([1e4, 1e4 - 64, -1e4, 0.0, 200.0, -200.0])
    x[0, 1] = torch.tensor([-1e4, -1e4, -1e4, -1e4, -1e4, -1e4 + 64])
    x[1, 0] = torch.tensor([200.0, 150.0, 100.0, 90.0, 89.0, -150.0])
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def weights_and_gradients(name, x, upstream, dtype, parameter=None, value=None):
    """The weights of ``x`` in ``dtype`` (bf16 with fp32 parameters, as under bf16-mixed) and the gradients of
    ``sum(w * upstream)`` in the scores and in every learned parameter, all as float64."""
    torch.manual_seed(0)  # the same initial parameters in every dtype
    module = reweighting.build(name, **({"learnable": True} if name == "softmax" else {}))
    module = module.to(torch.float32 if dtype == torch.bfloat16 else dtype)
    if name == "multimax":  # a fixed start: trunc_normal_'s draw from the same seed differs between torch releases
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.linspace(-0.03, 0.03, p.numel()).view_as(p))
    if parameter is not None:
        with torch.no_grad():
            getattr(module, parameter).fill_(value)
    x = x.to(dtype).requires_grad_()
    w = module(x)
    (w.double() * upstream).sum().backward()
    grads = {"scores": x.grad.double(), **{k: p.grad.double() for k, p in module.named_parameters()}}
    return w.detach().double(), grads


def extreme_cases():
    return [(name, None, None) for name in NAMES] + EXTREME_PARAMETERS


@pytest.mark.parametrize("dtype, tol", EXTREME_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, parameter, value", extreme_cases())
def test_extreme_scores_and_parameters_give_float64_weights_and_gradients(name, parameter, value, dtype, tol):
    """Weights and gradients (scores and learned parameters) at scores of +-1e4 and beyond fp32's exp range,
    and with each learned parameter at +-1e4 or past fp32's exp range, against float64 on the same (rounded)
    scores: everything finite; weights within ``tol``; the scores' gradient within ``tol`` of its largest
    entry (or of 1, the upstream gradient's size, when all are smaller: a saturated row's are ~0); a
    parameter's within ``tol`` of its natural size, that times the largest |score| (a parameter's gradient
    sums such terms, and fp32 rounds each of them)."""
    x, upstream = extreme_scores()
    x = x.to(dtype).double()  # what the module sees
    w, grads = weights_and_gradients(name, x, upstream, dtype, parameter, value)
    w64, grads64 = weights_and_gradients(name, x, upstream, torch.float64, parameter, value)
    assert torch.isfinite(w64).all() and all(torch.isfinite(g).all() for g in grads64.values())
    assert torch.isfinite(w).all() and all(torch.isfinite(g).all() for g in grads.values()), name
    torch.testing.assert_close(w, w64, rtol=0, atol=tol)
    scale = max(grads64["scores"].abs().max().item(), 1.0)
    torch.testing.assert_close(grads["scores"], grads64["scores"], rtol=tol, atol=tol * scale)
    # MultiMax's modulated scores reach max|x| (and |ranges|, when set far out); fp32 rounds them to eps times
    # that, and its slopes' gradient multiplies the rounding by a lever of up to that plus max|x|: the
    # conditioning of the computation, not a defect (with ranges at 1e4, the fp32 gradient in one slope is
    # 2-5 off a float64 value of 0.1-0.3, under every torch release)
    reach = max(x.abs().max().item(), abs(value) if parameter == "ranges" else 0.0)
    conditioning = torch.finfo(torch.float32).eps * reach * (reach + x.abs().max().item()) if name == "multimax" else 0
    for key in grads.keys() - {"scores"}:
        size = scale * x.abs().max().item()
        message = lambda m, k=key: f"{k}: {m}"  # noqa: E731
        atol = max(tol * size, conditioning)
        torch.testing.assert_close(grads[key], grads64[key], rtol=tol, atol=atol, msg=message)


def test_a_learnable_temperature_far_out_gives_uniform_or_one_hot_weights_and_zero_gradients():
    """log T = +-100 (exp overflows fp32): T = e^100 makes every row uniform, e^-100 every row one-hot, as in
    float64, with finite zero gradients in log T (before, x / exp(100) gave NaN in fp32)."""
    x = torch.tensor([[1.0, 3.0, -2.0, 0.5]])
    for log_t, want in ((100.0, torch.full((1, 4), 0.25)), (-100.0, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))):
        module = reweighting.build("softmax", learnable=True)
        with torch.no_grad():
            module.log_temperature.fill_(log_t)
        w = module(x)
        torch.testing.assert_close(w, want, rtol=0, atol=1e-7)
        (w * torch.arange(4.0)).sum().backward()
        assert module.log_temperature.grad.item() == 0.0
    module = reweighting.build("softmax", learnable=True)
    with torch.no_grad():
        module.log_temperature.fill_(math.log(0.5))  # inside the bound: the plain formula
    torch.testing.assert_close(module(x), torch.softmax(x / 0.5, -1), rtol=1e-6, atol=0)
