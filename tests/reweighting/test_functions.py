"""Every reweighting function against an independent reference, plus the properties they share."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmlight import reweighting
from tests.reweighting import references as ref

NAMES = ["softmax", "multimax", "sparsemax", "entmax15", "evsoftmax", "topk"]


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
    kwargs = {"topk": {"k": 3}, "softmax": {"temperature": 0.7}}.get(name, {})
    module = reweighting.build(name, **kwargs)
    if name == "multimax":  # move away from the near-identity init so sigma matters
        with torch.no_grad():
            module.ranges.copy_(torch.tensor([-0.5, 0.8, -1.0, 1.2]))
            module.ts.copy_(torch.tensor([-0.6, -0.3, 0.2, -0.1]))
    return module.eval()


def test_registry_names():
    assert reweighting.available() == sorted(NAMES)
    from mmlight.models.vit import ReweightingName

    assert sorted(ReweightingName.__args__) == sorted(NAMES)


def test_build_rejects_unknown_name_and_option():
    with pytest.raises(ValueError, match="unknown reweighting 'softmx'"):
        reweighting.build("softmx")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['tempreature'\]"):
        reweighting.build("softmax", tempreature=2.0)


@pytest.mark.parametrize("name", NAMES)
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
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_simplex_monotone_and_equivariant(name, data):
    k = data.draw(st.integers(1, 12))
    values = data.draw(st.lists(st.floats(-5, 5), min_size=k, max_size=k))
    keep = data.draw(st.lists(st.booleans(), min_size=k, max_size=k))
    scores = torch.tensor(values, dtype=torch.float64)
    mask = torch.tensor(keep)
    module = reweighting.build(name).double().eval()  # the default init, as a new layer
    p = module(scores, mask)

    assert (p >= 0).all() and (p[~mask] == 0).all()
    assert p.sum().item() == pytest.approx(1.0 if mask.any() else 0.0, abs=1e-9)
    # monotone: among kept entries, a larger score never gets a smaller weight
    s, w = scores[mask], p[mask]
    order = torch.argsort(s)
    assert (w[order].diff() >= -1e-12).all()
    # permutation-equivariant
    perm = torch.randperm(k)
    torch.testing.assert_close(module(scores[perm], mask[perm]), p[perm])


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_float64(name):
    """Input gradients, and for MultiMax the gradients of ranges and ts, against finite differences."""
    module = make(name).double()
    scores = (torch.randn(2, 6, dtype=torch.float64) * 2).requires_grad_()
    mask = torch.tensor([[True, True, False, True, True, True], [True] * 6])
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    params = [p.detach().clone().requires_grad_() for n, p in module.named_parameters() if p.requires_grad]

    def fn(x, *ps):
        return torch.func.functional_call(module, dict(zip(names, ps)), (x, mask))

    assert torch.autograd.gradcheck(fn, (scores, *params))
    if name == "multimax":
        assert names == ["ranges", "ts"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(name, dtype):
    module = make(name)
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
    module = make(name)
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
    if name == "multimax":
        assert all(torch.isfinite(q.grad).all() for q in module.parameters())


def test_empty_batch():
    for name in NAMES:
        p = make(name)(torch.randn(0, 4, 7), torch.ones(0, 4, 7, dtype=torch.bool))
        assert p.shape == (0, 4, 7)
