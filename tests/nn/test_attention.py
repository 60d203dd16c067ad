"""The attention entry point: fused and explicit paths agree, masks and causality are right."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from timm.layers import Attention as TimmAttention

from mmlight import reweighting
from mmlight.nn import ReweightedAttention, attention, causal_mask
from mmlight.nn.attention import key_padding_of, keys_seen, with_causal
from mmlight.reweighting import MultiMax
from mmlight.reweighting import backend as backend_module
from mmlight.reweighting.fused import SigmaKernels

attention_module = importlib.import_module("mmlight.nn.attention")  # the package re-exports the function


def manual_attention(q, k, v, mask, scale):
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, -1))  # empty rows -> 0
    return probs @ v


def qkv(B=2, H=3, Tq=5, Tk=5, D=8):
    return (
        torch.randn(B, H, Tq, D, dtype=torch.float64),
        torch.randn(B, H, Tk, D, dtype=torch.float64),
        torch.randn(B, H, Tk, D, dtype=torch.float64),
    )


def zero_ts_multimax():
    module = reweighting.build("multimax").double()
    with torch.no_grad():
        module.ts.zero_()
    return module


def test_causal_mask_bottom_right():
    m = causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


@pytest.mark.parametrize("is_causal", [False, True])
def test_fused_and_explicit_paths_match_manual(is_causal):
    q, k, v = qkv()
    mask = torch.rand(2, 1, 1, 5) > 0.3
    mask[0, ..., :] = False  # batch 0: every key padded
    mask[1, ..., 0] = True
    full = mask & causal_mask(5, 5) if is_causal else mask.expand(2, 1, 5, 5)
    want = manual_attention(q, k, v, full, 8**-0.5)
    softmax = reweighting.build("softmax")
    assert softmax.sdpa_scale == 1.0  # takes the fused path
    fused = attention(q, k, v, softmax, mask=mask, is_causal=is_causal)
    explicit = attention(q, k, v, zero_ts_multimax(), mask=mask, is_causal=is_causal)
    torch.testing.assert_close(fused, want)
    torch.testing.assert_close(explicit, want)
    assert (fused[0] == 0).all()


@pytest.mark.parametrize("masked", [False, True])
def test_temperature_folds_into_sdpa_scale(masked):
    q, k, v = qkv()
    mask = torch.rand(2, 3, 5, 5) > 0.3 if masked else torch.ones(5, 5, dtype=torch.bool)
    got = attention(q, k, v, reweighting.build("softmax", temperature=0.5), mask=mask if masked else None)
    want = manual_attention(q, k, v, mask, 8**-0.5 / 0.5)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", reweighting.available())
def test_incremental_query_matches_full_causal(name):
    q, k, v = qkv(Tq=6, Tk=6)
    fn = reweighting.build(name).double()
    full = attention(q, k, v, fn, is_causal=True)
    last = attention(q[:, :, -2:], k, v, fn, is_causal=True)  # 2 new queries over a 6-key cache
    torch.testing.assert_close(last, full[:, :, -2:])


@pytest.mark.parametrize("name", reweighting.available())
def test_no_key_gives_a_zero_output(name):
    """A query with no key at all is answered like one whose keys are all masked: zero, with gradients."""
    q, k, v = (t.requires_grad_() for t in qkv(Tk=0))
    out = attention(q, k, v, reweighting.build(name).double(), is_causal=True)
    out.sum().backward()
    assert out.shape == (2, 3, 5, 8) and (out == 0).all() and (q.grad == 0).all()


@pytest.mark.parametrize("name", reweighting.available())
def test_padded_causal_batch_has_finite_grads(name):
    q, k, v = (t.float().requires_grad_() for t in qkv())
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., :] = False
    out = attention(q, k, v, reweighting.build(name), mask=mask, is_causal=True)
    out.sum().backward()
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_reweighted_attention_equals_timm_attention():
    torch.manual_seed(0)
    timm_attn = TimmAttention(32, num_heads=4, qkv_bias=True).eval()
    ours = ReweightedAttention(32, num_heads=4, qkv_bias=True).eval()
    ours.load_state_dict(timm_attn.state_dict())  # same parameters, so timm weights load
    x = torch.randn(2, 7, 32)
    torch.testing.assert_close(ours(x), timm_attn(x))
    mask = torch.rand(2, 1, 7, 7) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(ours(x, attn_mask=mask), timm_attn(x, attn_mask=mask))
    with pytest.raises(TypeError, match=r"^ReweightedAttention takes a boolean attn_mask \(True = attend\)$"):
        ours(x, attn_mask=mask.float())
    timm_attn.scale = ours.scale = 0.2  # a changed temperature is used (timm's unfused path reads it)
    timm_attn.fused_attn = False
    torch.testing.assert_close(ours(x, attn_mask=mask), timm_attn(x, attn_mask=mask))


def test_reweighted_attention_equals_timm_attention_with_every_option():
    """Gate, query/key and output norms, causality and attention dropout (none in eval mode; in training
    the same draws as timm's fused SDPA): the same output as timm's layer with the same parameters."""
    torch.manual_seed(0)
    options = dict(num_heads=2, gated=True, qk_norm=True, scale_norm=True, norm_layer=torch.nn.LayerNorm)
    timm_attn = TimmAttention(16, attn_drop=0.5, **options)
    with torch.no_grad():
        for p in timm_attn.parameters():
            p.normal_()  # the norms' unit weights and zero biases would hide a skipped norm
    ours = ReweightedAttention(16, attn_drop=0.5, **options)
    ours.load_state_dict(timm_attn.state_dict())
    assert timm_attn.fused_attn  # timm calls SDPA too, so training-mode dropout draws the same mask
    x = torch.randn(2, 5, 16)
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True
    for mode in ("eval", "train"):
        timm_attn.train(mode == "train"), ours.train(mode == "train")
        for options in ({"is_causal": False}, {"is_causal": True}, {"attn_mask": mask}):
            torch.manual_seed(1)
            want = timm_attn(x, **options)
            torch.manual_seed(1)
            torch.testing.assert_close(ours(x, **options), want)


@pytest.mark.parametrize("shape", [(7,), (1, 7), (1, 1, 7), (2, 1, 1, 7), (1, 1, 1, 7)])
def test_key_padding_forms_are_recognised(shape):
    mask = torch.rand(shape) > 0.5
    padding = key_padding_of(mask, 2, 7)
    assert padding.shape == (2, 7)
    assert torch.equal(padding.reshape(2, 1, 1, 7), mask.reshape(-1, 1, 1, 7).expand(2, 1, 1, 7))


@pytest.mark.parametrize("shape", [(2, 3, 1, 7), (2, 1, 5, 7), (2, 1, 1, 1), (2, 1, 7)])
def test_other_masks_are_not_key_padding(shape):
    assert key_padding_of(torch.ones(shape, dtype=torch.bool), 2, 7) is None


@pytest.mark.parametrize("mask_kind", ["none", "padding", "general"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_triton_backend_matches_reference(mask_kind, is_causal):
    """Fused attention (no mask, key padding) and the row-wise kernel (a general mask) agree with
    the reference path, gradients of q, k, v and the MultiMax parameters included."""
    q, k, v = (t.float() for t in qkv(B=2, H=2, Tq=9, Tk=9, D=16))
    masks = {
        "none": None,
        "padding": torch.tensor([[True] * 9, [True] * 5 + [False] * 4]).reshape(2, 1, 1, 9),
        "general": torch.rand(2, 2, 9, 9) > 0.3,
    }
    mask = masks[mask_kind]
    module = MultiMax(order=2)
    with torch.no_grad():
        module.ranges.copy_(torch.tensor([-0.5, 0.6, -1.0, 1.2]))
        module.ts.copy_(torch.tensor([0.3, 0.25, 0.1, 0.05]))
    outputs, grads = {}, {}
    for backend in ("reference", "triton"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        module.zero_grad()
        out = attention(*leaves, module, mask=mask, is_causal=is_causal, backend=backend)
        out.pow(2).sum().backward()
        outputs[backend] = out
        grads[backend] = [t.grad for t in leaves] + [module.ranges.grad.clone(), module.ts.grad.clone()]
    torch.testing.assert_close(outputs["triton"], outputs["reference"], atol=1e-5, rtol=1e-4)
    for g_fused, g_ref in zip(grads["triton"], grads["reference"]):
        torch.testing.assert_close(g_fused, g_ref, atol=1e-5, rtol=1e-3)


def test_triton_backend_takes_an_empty_batch():
    q, k, v = (t.float()[:0].requires_grad_() for t in qkv(B=2, H=2, Tq=9, Tk=9, D=16))
    out = attention(q, k, v, MultiMax(), is_causal=True, backend="triton")
    out.sum().backward()
    assert out.shape == (0, 2, 9, 16) and q.grad.shape == q.shape


def test_key_padding_of_no_mask_or_a_five_dim_mask_is_none():
    assert key_padding_of(None, 2, 7) is None
    # five dims whose last four would read as a key padding: still none (the entry point takes 4-D masks)
    assert key_padding_of(torch.ones(1, 1, 1, 7, 7, dtype=torch.bool), 2, 7) is None


def test_dropout_drops_the_weights_of_the_explicit_path():
    """The explicit path drops out the weights (not the output), rescaled by 1 / (1 - p): the same
    draws on the weights computed by hand give the same output."""
    q, k, v = qkv()
    probs, softmax = torch.softmax((q @ k.transpose(-2, -1)) * 8**-0.5, -1), zero_ts_multimax()
    torch.manual_seed(3)
    got = attention(q, k, v, softmax, dropout_p=0.3)
    torch.manual_seed(3)
    want = F.dropout(probs, p=0.3, training=True) @ v
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, probs @ v)


def hand_multimax_attention(module, q, k, v, scale, causal, key_padding):
    """What the fused MultiMax kernel computes, from its arguments alone: the module's reference on
    scores masked bottom-right causally and by ``key_padding`` ``(B, Tk)``."""
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    if causal:
        keep = keep & causal_mask(q.shape[-2], k.shape[-2])
    if key_padding is not None:
        keep = keep & key_padding[:, None, None, :]
    return module.reference((q @ k.transpose(-2, -1)) * scale, keep.expand(q.shape[0], 1, -1, -1)) @ v


class KernelCalls(list):
    """The stand-in kernel's calls ``(q, k, v, scale, causal, key_padding)``, what it returns, the module it
    computes for, and the functions ``torch.compile`` was given."""

    def __init__(self):
        super().__init__()
        self.result, self.module_of, self.compiled = "compute", [], []


@pytest.fixture
def stand_in_kernel(monkeypatch):
    """``auto`` picks ``triton`` in the entry point, and the fused attention kernel is a stand-in that
    records its arguments and computes by hand (:func:`hand_multimax_attention`), or returns what
    ``calls.result`` says ("none": no kernel for these inputs, "raise": fails as a kernel that does not
    compile). Everything else runs on the reference backend."""
    calls = KernelCalls()

    def choose_triton(requested, tensor, has_kernel, owner):
        return "triton" if has_kernel and requested == "auto" and tensor.is_floating_point() else requested

    def kernel(self, q, k, v, scale, causal, key_padding):
        calls.append((q, k, v, scale, causal, key_padding))
        if calls.result == "none":
            return None
        if calls.result == "raise":
            raise RuntimeError("PTXASError: ptxas ran out of registers")
        return hand_multimax_attention(module_of[0], q, k, v, scale * self.scale, causal, key_padding)

    module_of = calls.module_of
    monkeypatch.setattr(attention_module, "resolve_backend", choose_triton)
    monkeypatch.setattr(SigmaKernels, "attention", kernel)
    monkeypatch.setattr(backend_module, "FAILED_KERNELS", {})
    monkeypatch.setattr(backend_module, "_PROBED", set())
    # the fallback's compile backend, run eagerly; counted
    monkeypatch.setattr(torch, "compile", lambda fn: calls.compiled.append(fn) or fn)
    return calls


def multimax_double():
    module = MultiMax(order=2).double()
    with torch.no_grad():
        module.ranges.copy_(torch.tensor([-0.5, 0.6, -1.0, 1.2]))
        module.ts.copy_(torch.tensor([0.3, 0.25, 0.1, 0.05]))
    return module


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_the_fused_kernel_takes_no_mask_or_a_key_padding(stand_in_kernel, is_causal, padded):
    """MultiMax with at most a key-padding mask goes to the fused kernel with the call's scale, causality
    and the ``(B, Tk)`` padding; its output is the call's output and equals the reference path's."""
    q, k, v = qkv(B=2, H=3, Tq=4, Tk=6)
    module = multimax_double()
    stand_in_kernel.module_of.append(module)
    padding = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    mask = padding[:, None, None, :] if padded else None
    got = attention(q, k, v, module, mask=mask, is_causal=is_causal, scale=0.3)
    [(q_in, k_in, v_in, scale, causal, key_padding)] = stand_in_kernel
    assert q_in is q and k_in is k and v_in is v and scale == 0.3 and causal is is_causal
    assert backend_module.FAILED_KERNELS == {}  # the kernel ran; no fallback
    assert (key_padding is None) if not padded else torch.equal(key_padding, padding)
    want = attention(q, k, v, module, mask=mask, is_causal=is_causal, scale=0.3, backend="reference")
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "case", ["general mask", "dropout", "empty batch", "no key", "softmax", "kernel declines", "reference"]
)
def test_other_calls_take_the_explicit_path(stand_in_kernel, case):
    """A general mask, dropout, an empty batch or key set, a function SDPA computes, an explicit
    backend, or a kernel that declines the inputs (None): the result is the reference path's."""
    B, Tk = {"empty batch": (0, 5), "no key": (2, 0)}.get(case, (2, 5))
    q, k, v = qkv(B=B, Tk=Tk)
    module = reweighting.build("softmax") if case == "softmax" else multimax_double()
    stand_in_kernel.module_of.append(module)
    stand_in_kernel.result = "none" if case == "kernel declines" else "raise"
    mask = torch.rand(B, 3, 5, Tk) > 0.3 if case == "general mask" else None
    dropout_p = 0.3 if case == "dropout" else 0.0
    backend = "reference" if case == "reference" else None
    torch.manual_seed(0)
    got = attention(q, k, v, module, mask=mask, dropout_p=dropout_p, backend=backend)
    torch.manual_seed(0)
    want = attention(q, k, v, module, mask=mask, dropout_p=dropout_p, backend="reference")
    torch.testing.assert_close(got, want)
    assert len(stand_in_kernel) == (case == "kernel declines")


def test_the_smallest_inputs_still_take_the_fused_kernel(stand_in_kernel):
    q, k, v = (t[:1, :1, :1, :1] for t in qkv(B=1, H=1, Tq=1, Tk=1, D=1))  # one query, one key, one feature
    module = multimax_double()
    stand_in_kernel.module_of.append(module)
    torch.testing.assert_close(attention(q, k, v, module), v)  # one key: all the weight
    assert len(stand_in_kernel) == 1


def test_a_failing_kernel_falls_back_to_the_same_call_under_auto(stand_in_kernel):
    """The fallback computes the same call (mask, causality, scale) on the compile backend (on a GPU,
    ``auto`` would pick the row-wise kernel again)."""
    q, k, v = qkv(B=2, H=3, Tq=4, Tk=6)
    module = multimax_double()
    stand_in_kernel.result = "raise"
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])[:, None, None, :]
    with pytest.warns(RuntimeWarning, match="MultiMax attention"):
        got = attention(q, k, v, module, mask=mask, is_causal=True, scale=0.3)
    assert len(stand_in_kernel.compiled) == 1
    want = attention(q, k, v, module, mask=mask, is_causal=True, scale=0.3, backend="reference")
    torch.testing.assert_close(got, want)
    assert len(stand_in_kernel) == 1


def test_keys_seen_counts_each_querys_keys_in_four_dims():
    """Counted by hand: a mask's kept keys per query, SDPA's top-left causal ``i + 1``, or every key; always
    ``(B|1, nh|1, Tq, 1)``, on the device asked for."""
    padding = torch.tensor([[True, True, False], [True, False, False]])  # (B, Tk)
    counts = keys_seen(padding[:, None, None, :], False, 4, 3, None)
    assert counts.shape == (2, 1, 4, 1) and counts[:, 0, :, 0].tolist() == [[2] * 4, [1] * 4]
    general = torch.tensor([[True, False, True], [False, False, False]])  # (Tq, Tk), left-padded to 4-D
    assert keys_seen(general, False, 2, 3, None).tolist() == [[[[2], [0]]]]
    assert keys_seen(None, True, 3, 3, None).tolist() == [[[[1], [2], [3]]]]
    assert keys_seen(None, False, 2, 5, None).tolist() == [[[[5], [5]]]]
    meta = torch.device("meta")
    assert keys_seen(None, True, 3, 3, meta).device == meta and keys_seen(None, False, 3, 3, meta).device == meta


def test_with_causal_narrows_a_mask_on_its_device():
    mask = torch.tensor([[True, False, True, True]])  # (1, Tk): key 1 padded
    assert with_causal(mask, 2, 4, None).tolist() == [[True, False, True, False], [True, False, True, True]]
    assert torch.equal(with_causal(None, 2, 4, None), causal_mask(2, 4))
    meta = torch.device("meta")
    assert with_causal(None, 2, 4, meta).device == meta and causal_mask(2, 4, meta).device == meta


def textbook_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """SDPA as the formula reads, NaN for a query with no key (as some PyTorch kernels return): the entry
    point must not rely on the CPU kernels' zeros."""
    assert dropout_p == 0.0 and not is_causal
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


def test_a_query_with_no_key_is_zero_even_where_sdpa_gives_nan(monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", textbook_sdpa)
    q, k, v = qkv()
    mask = torch.rand(2, 3, 5, 5) > 0.3
    mask[0, 1, 2] = False  # one query of one head sees no key
    mask[1, :, :, 0] = True
    assert textbook_sdpa(q, k, v, mask)[0, 1, 2].isnan().all()
    got = attention(q, k, v, reweighting.build("softmax"), mask=mask)
    torch.testing.assert_close(got, manual_attention(q, k, v, mask, 8**-0.5))
    assert (got[0, 1, 2] == 0).all() and got.isfinite().all()


@pytest.mark.parametrize("name", ["softmax", "ssmax", "multimax"])
@pytest.mark.parametrize("q_len", [3, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_what_the_entry_point_makes_is_on_the_inputs_device(name, q_len, padded):
    """The causal mask and the key counts are made on the inputs' device: on the meta device a CPU tensor
    mixed in raises. SDPA (softmax), scaled queries (ssmax) and explicit scores (multimax)."""
    meta = torch.device("meta")
    q, k = torch.empty(2, 3, q_len, 8, device=meta), torch.empty(2, 3, 5, 8, device=meta)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool, device=meta) if padded else None
    out = attention(q, k, k, reweighting.build(name).to(meta), mask=mask, is_causal=True)
    assert out.device == meta and out.shape == (2, 3, q_len, 8)


def test_the_explicit_path_computes_on_the_calls_backend(monkeypatch):
    """``backend="compile"`` compiles the function's reference (here: counted, run eagerly)."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn: compiled.append(fn) or fn)
    q, k, v = qkv()
    module = multimax_double()
    got = attention(q, k, v, module, is_causal=True, backend="compile")
    assert len(compiled) == 1
    torch.testing.assert_close(got, attention(q, k, v, module, is_causal=True, backend="reference"))


@pytest.mark.parametrize("name", reweighting.available())
def test_a_given_scale_equals_the_default_on_rescaled_queries(name):
    """``scale=c`` is the default ``hs ** -0.5`` on queries times ``c * hs ** 0.5``, on every path."""
    q, k, v = qkv()
    mask = torch.rand(2, 1, 1, 5) > 0.3
    mask[..., 0] = True
    fn = reweighting.build(name).double()
    for options in ({"is_causal": True}, {"mask": mask, "is_causal": name == "stickbreaking"}):
        got = attention(q, k, v, fn, scale=0.3, **options)
        torch.testing.assert_close(got, attention(q * 0.3 * 8**0.5, k, v, fn, **options))


def test_scaled_queries_keep_the_inputs_precision():
    """Scalable-Softmax with float32 parameters on bfloat16 inputs (as under autocast): a bfloat16 output
    close to the float64 one."""
    q, k, v = (t.bfloat16() for t in qkv())
    fn = reweighting.build("ssmax")
    assert fn.s.dtype == torch.float32
    out = attention(q, k, v, fn, is_causal=True)
    want = attention(*(t.double() for t in (q, k, v)), fn.double(), is_causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=0.05, rtol=0.05)


def test_a_causal_only_function_refuses_non_causal_attention_by_name():
    refusal = r"^StickBreaking weighs keys by their position before the query and needs is_causal=True$"
    with pytest.raises(ValueError, match=refusal):
        attention(*qkv(), reweighting.build("stickbreaking"))


@pytest.mark.parametrize("name", ["softmax", "ssmax"])
@pytest.mark.parametrize("q_len, padded, as_is_causal", [(5, False, True), (3, False, False), (5, True, False)])
def test_sdpa_gets_is_causal_where_it_aligns_and_a_mask_otherwise(monkeypatch, name, q_len, padded, as_is_causal):
    """Causal softmax over as many keys as queries and no mask reaches SDPA as ``is_causal`` (which its flash
    kernels take; a mask would rule them out); fewer queries than keys (SDPA aligns top-left) or a mask: the
    causal mask folded into the mask."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal", False)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v = qkv(Tq=q_len)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool) if padded else None
    attention(q, k, v, reweighting.build(name).double(), mask=mask, is_causal=True)
    assert seen == [(as_is_causal, as_is_causal)]


# ---------------------------------------------------------------------------------------------
# Grouped-query attention


@pytest.mark.parametrize("name", reweighting.available())
@pytest.mark.parametrize("n_kv", [1, 2])
@pytest.mark.parametrize("padded", [True, False])
def test_grouped_keys_equal_each_query_head_with_its_group_s_key_head(name, n_kv, padded):
    """Each query head ``h`` of 4 against key/value head ``h // (4 // n_kv)``, computed one head at a time
    (every path: SDPA for softmax and ssmax, explicit scores for the others; causal, with a padded key or
    with no mask, SDPA's own causal path)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    k, v = torch.randn(2, n_kv, 5, 8, dtype=torch.float64), torch.randn(2, n_kv, 5, 8, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., 1] = False
    mask = mask if padded else None
    module = reweighting.build(name, num_heads=4) if name == "sink" else reweighting.build(name)
    module = module.double()
    if name == "sink":
        with torch.no_grad():
            module.sink_logit.copy_(torch.tensor([-1.0, 0.0, 0.5, 2.0]))  # one per query head, all different
    got = attention(q, k, v, module, mask=mask, is_causal=True)
    group = 4 // n_kv
    for h in range(4):
        one = reweighting.build(name, num_heads=1) if name == "sink" else module
        if name == "sink":
            one = one.double()
            with torch.no_grad():
                one.load_state_dict({key: val[h : h + 1] for key, val in module.state_dict().items()})
        kh, vh = k[:, h // group : h // group + 1], v[:, h // group : h // group + 1]
        want = attention(q[:, h : h + 1], kh, vh, one, mask=mask, is_causal=True)
        torch.testing.assert_close(got[:, h : h + 1], want, rtol=1e-10, atol=1e-10)


def test_key_heads_that_do_not_divide_the_query_heads_are_refused():
    q, k, v = torch.randn(1, 3, 2, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    with pytest.raises(ValueError, match="key/value heads must be equal and divide the query heads"):
        attention(q, k, v, reweighting.build("softmax"))
