"""The fused MultiMax attention kernel against an independent float64 PyTorch reference.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
so every shape here is tiny. Most tests force 16-wide tiles so that lengths like 19 and 37 span
several query and key blocks, partial last blocks and skipped causal blocks.
"""

import pytest
import torch
import torch.nn.functional as F

from mmlight.kernels import attention as kernel
from mmlight.kernels.attention import multimax_attention
from mmlight.reweighting.multimax import multimax_sigma

# large enough that sigma bends the scores (the 0.02-std init is almost the identity)
RANGES = {1: [-0.5, 0.5], 2: [-0.5, 0.5, -1.0, 1.0]}
TS = {1: [0.3, 0.2], 2: [0.3, 0.2, 0.1, 0.05]}


def use_blocks(monkeypatch, block_m, block_n):
    """Force ``block_m`` x ``block_n`` tiles in every kernel."""
    cfg = kernel.BlockConfig(block_m, block_n, num_warps=4, num_stages=1)
    monkeypatch.setattr(kernel, "forward_config", lambda *args: cfg)
    monkeypatch.setattr(kernel, "backward_configs", lambda *args: (cfg, cfg))


@pytest.fixture
def small_blocks(monkeypatch):
    """16 x 16 tiles: lengths 19 and 37 span 2 and 3 blocks, the last one partial."""
    use_blocks(monkeypatch, 16, 16)


def make_inputs(B=2, H=2, Tq=19, Tk=37, D=32, order=2, dtype=torch.float32, seed=0):
    """Leaf tensors ``(q, k, v, ranges, ts)``; ranges and ts are None for plain softmax."""
    gen = torch.Generator().manual_seed(seed)
    q = (1.5 * torch.randn(B, H, Tq, D, generator=gen)).to(dtype).requires_grad_()
    k = torch.randn(B, H, Tk, D, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, H, Tk, D, generator=gen).to(dtype).requires_grad_()
    if order is None:
        return q, k, v, None, None
    ranges = torch.tensor(RANGES[order], requires_grad=True)
    ts = torch.tensor(TS[order], requires_grad=True)
    return q, k, v, ranges, ts


def make_padding(B, Tk, seed=1):
    """Random key padding (True = keep) with at least one kept and one dropped key per batch row."""
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, Tk, generator=gen) > 0.3
    keep[:, 0] = True
    keep[:, -1] = False
    return keep


def reference(q, k, v, ranges=None, ts=None, scale=None, causal=False, key_padding=None):
    """Plain float64 attention with the full score matrix; a row without keys gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]  # grouped-query attention: query head h reads key head h // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    Tq, Tk = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    x = q @ k.transpose(-2, -1) * scale  # (B, H, Tq, Tk)
    s = x if ranges is None else multimax_sigma(x, ranges.double(), ts.double())
    keep = torch.ones(q.shape[0], 1, Tq, Tk, dtype=torch.bool)
    if causal:
        query_pos = torch.arange(Tq)[:, None] + (Tk - Tq)  # bottom-right aligned
        keep = keep & (torch.arange(Tk)[None, :] <= query_pos)
    if key_padding is not None:
        keep = keep & key_padding[:, None, None, :]
    has_key = keep.any(dim=-1, keepdim=True)
    # rows without keys softmax a row of zeros instead of -inf (NaN), then are zeroed
    s = torch.where(keep, s, float("-inf")).masked_fill(~has_key, 0.0)
    p = torch.where(keep, torch.softmax(s, dim=-1), 0.0)
    return p @ v


def run(fn, inputs, grad_out, **kwargs):
    """``fn(*inputs, **kwargs)`` and the gradients of ``(out * grad_out).sum()`` (None if unused)."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    out = fn(*leaves, **kwargs)
    (out.double() * grad_out.double()).sum().backward()
    return out, [None if t is None else t.grad for t in leaves]


def assert_close(actual, expected, tol, what=""):
    """Max abs error within ``tol`` times the expected magnitude (at least 1)."""
    assert actual is not None and expected is not None, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).abs().max().item()
    bound = tol * max(1.0, expected.double().abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def check_against_reference(inputs, tol_out, tol_grad, tol_param=1e-4, **kwargs):
    """Kernel vs float64 reference: output and the gradients of every input that requires grad.

    ``tol_param`` is looser than ``tol_grad``: the ranges/ts gradients are sums over every
    (query, key) pair with a lot of cancellation, so fp32 rounding shows more in them.
    """
    gen = torch.Generator().manual_seed(7)
    # rounded to the input dtype so that kernel and reference get the same output gradient
    grad_out = torch.randn(inputs[0].shape, generator=gen).to(inputs[0].dtype)
    out, grads = run(multimax_attention, inputs, grad_out, **kwargs)
    ref_out, ref_grads = run(reference, inputs, grad_out, **kwargs)
    assert out.dtype == inputs[0].dtype and out.shape == inputs[0].shape
    assert_close(out, ref_out, tol_out, "output")
    for name, g, ref_g in zip(("q", "k", "v", "ranges", "ts"), grads, ref_grads):
        if ref_g is not None:
            assert_close(g, ref_g, tol_param if name in ("ranges", "ts") else tol_grad, f"grad {name}")
    return out, grads


@pytest.mark.parametrize(
    "Tq, Tk, causal, padded, order, scale, blocks",
    [
        (37, 37, False, False, 2, None, (16, 16)),  # self-attention, no mask
        (19, 37, True, False, 1, None, (16, 32)),  # cross, causal, Tq < Tk
        (37, 19, True, False, 2, 0.3, (32, 16)),  # causal, Tq > Tk: the first 18 queries see no key
        (37, 37, True, False, 2, None, (32, 16)),  # causal self-attention, BLOCK_M > BLOCK_N
        (37, 37, False, True, 1, None, (16, 32)),  # key padding
        (20, 37, True, True, 2, None, (16, 16)),  # causal + padding; Tk - Tq = 17 = 1 mod 16 puts
        # a query block's last visible key first in its key block: catches off-by-one block skipping
        (37, 19, True, True, None, None, (16, 16)),  # plain softmax, causal + padding
    ],
)
def test_matches_reference(monkeypatch, Tq, Tk, causal, padded, order, scale, blocks):
    use_blocks(monkeypatch, *blocks)
    inputs = make_inputs(Tq=Tq, Tk=Tk, order=order)
    pad = make_padding(2, Tk) if padded else None
    check_against_reference(inputs, 1e-5, 2e-5, scale=scale, causal=causal, key_padding=pad)


@pytest.mark.parametrize("kv_heads, causal, order", [(1, True, 2), (2, True, None), (2, False, 1)])
def test_grouped_key_value_heads_match_reference(small_blocks, kv_heads, causal, order):
    """4 query heads over 1 or 2 key/value heads, read through the kernels' pointer math (no copy): output
    and gradients (dK, dV summed over each group) against the float64 reference with expanded heads."""
    q, k, v, ranges, ts = make_inputs(H=4, Tq=19, Tk=37, order=order)
    k = k.detach()[:, :kv_heads].clone().requires_grad_()
    v = v.detach()[:, :kv_heads].clone().requires_grad_()
    check_against_reference((q, k, v, ranges, ts), 1e-5, 2e-5, causal=causal, key_padding=make_padding(2, 37))


def test_a_llama_style_network_runs_the_kernel_with_rotary_positions_and_grouped_heads():
    """MultiMax in a Llama-style LM (rotary q/k, 4 query heads over 2 key/value heads, QK-norm): the triton
    backend (the fused kernel) gives the reference backend's loss and gradients."""
    from mmlight.models.transformer import LLAMA_STYLE, TransformerConfig, TransformerLM
    from mmlight.reweighting import ReweightingSpec

    fields = dict(vocab_size=29, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=64, n_layers=1, qk_norm=True)
    x = torch.randint(2, 29, (2, 20), generator=torch.Generator().manual_seed(0))
    results = []
    for backend in ("reference", "triton"):
        torch.manual_seed(0)
        config = TransformerConfig(**fields, **LLAMA_STYLE, attention=ReweightingSpec("multimax"), backend=backend)
        model = TransformerLM(config)
        calls = []
        original = kernel._attention
        kernel_calls = lambda *a: calls.append(a[1].shape) or original(*a)  # noqa: E731
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernel, "_attention", kernel_calls)
            loss, _ = model.loss(x, torch.roll(x, -1, 1))
            loss.backward()
        assert calls == ([] if backend == "reference" else [(2, 2, 20, 16)])  # the kernel got 2 key heads
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_fully_padded_batch_row_gives_zeros(small_blocks):
    q, k, v, ranges, ts = make_inputs(Tq=19, Tk=37, order=2)
    pad = make_padding(2, 37)
    pad[1] = False  # batch row 1 has no key at all
    out, grads = check_against_reference((q, k, v, ranges, ts), 1e-5, 2e-5, key_padding=pad)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for g in grads[:3]:
        assert torch.equal(g[1], torch.zeros_like(g[1]))
    # and fully causal-masked rows (Tq > Tk) together with padding
    check_against_reference(make_inputs(Tq=37, Tk=19, order=1), 1e-5, 2e-5, causal=True, key_padding=pad[:, :19])


def test_saved_row_statistics(small_blocks):
    """Per row (fp32): the max m of sigma over kept keys and 1 / sum_j exp(s_j - m), together the
    log-sum-exp; 0 and 0 for a row without keys."""
    q, k, v, ranges, ts = make_inputs(Tq=37, Tk=19, order=2)
    params, order = kernel.pack_sigma_params(ranges, ts, q.device)
    _, row_max, row_inv_sum = kernel._forward(q.detach(), k.detach(), v.detach(), params, order, 32**-0.5, True, None)
    x = q.detach().double() @ k.detach().double().transpose(-2, -1) * 32**-0.5
    s = multimax_sigma(x, ranges.detach().double(), ts.detach().double())
    keep = torch.ones(37, 19, dtype=torch.bool).tril(19 - 37)
    masked = s.masked_fill(~keep, float("-inf"))
    want_lse = torch.logsumexp(masked, dim=-1)  # -inf where no key
    assert row_max.dtype == row_inv_sum.dtype == torch.float32 and row_max.shape == row_inv_sum.shape == (2, 2, 37)
    assert (row_max[:, :, :18] == 0).all() and (row_inv_sum[:, :, :18] == 0).all()
    assert_close(row_max[:, :, 18:], masked.amax(-1)[:, :, 18:], 1e-6, "row max")
    lse = row_max.double() - row_inv_sum.double().log()
    assert_close(lse[:, :, 18:], want_lse[:, :, 18:], 1e-6, "log-sum-exp")


@pytest.mark.parametrize("D", [16, 32, 64, 128])
def test_head_dims_default_blocks(D):
    """The production tile sizes (one tile per head at these lengths), every supported D."""
    check_against_reference(
        make_inputs(Tq=23, Tk=29, D=D, order=2), 1e-5, 2e-5, causal=True, key_padding=make_padding(2, 29)
    )


@pytest.mark.parametrize("causal, Tq, Tk", [(False, 19, 37), (True, 37, 37), (True, 19, 37)])
def test_plain_softmax_matches_sdpa(small_blocks, causal, Tq, Tk):
    q, k, v, _, _ = make_inputs(Tq=Tq, Tk=Tk, order=None)
    pad = make_padding(2, Tk)
    keep = pad[:, None, None, :]
    if causal:
        keep = keep & torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
    grad_out = torch.randn(2, 2, Tq, 32)
    out, grads = run(multimax_attention, (q, k, v), grad_out, causal=causal, key_padding=pad)
    sdpa_out, sdpa_grads = run(F.scaled_dot_product_attention, (q, k, v), grad_out, attn_mask=keep)
    assert_close(out, sdpa_out, 1e-5, "output")
    for name, g, ref_g in zip("qkv", grads, sdpa_grads):
        assert_close(g, ref_g, 2e-5, f"grad {name}")


@pytest.mark.parametrize("dtype, tol_out, tol_grad", [(torch.float16, 4e-3, 1e-2), (torch.bfloat16, 3e-2, 6e-2)])
def test_half_precision(small_blocks, dtype, tol_out, tol_grad):
    """fp16/bf16 inputs (P and dS are rounded to the input dtype before the matmuls, as in FA2)."""
    inputs = make_inputs(Tq=19, Tk=37, order=2, dtype=dtype)
    out, grads = check_against_reference(
        inputs, tol_out, tol_grad, tol_param=tol_grad, causal=True, key_padding=make_padding(2, 37)
    )
    assert all(g.dtype == dtype for g in grads[:3])
    assert grads[3].dtype == grads[4].dtype == torch.float32


#: Kernel switches (module attributes of kernels/attention.py), each tested away from its shipped
#: default against the reference (the shipped setting is what every other test runs).
SWITCHES = ["PARAM_SUMS_PER_PROGRAM", "OUTPUT_IN_CALLER_LAYOUT", "SINGLE_PASS_BACKWARD", "MASK_FREE_INTERIOR"]


def flip(monkeypatch, switch: str) -> None:
    """Set a kernel switch to the setting it does not ship with."""
    monkeypatch.setattr(kernel, switch, not getattr(kernel, switch))


@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize(
    "Tq, Tk, causal, padded, blocks",
    [
        (37, 37, False, False, (16, 16)),
        (20, 37, True, True, (16, 16)),  # causal + padding, Tq < Tk, partial blocks
        (20, 37, True, False, (16, 16)),  # causal, Tq < Tk: whole key blocks before the diagonal
        (37, 19, True, False, (32, 16)),  # queries that see no key
    ],
)
def test_kernel_switches_match_reference(monkeypatch, switch, Tq, Tk, causal, padded, blocks):
    flip(monkeypatch, switch)
    use_blocks(monkeypatch, *blocks)
    inputs = make_inputs(Tq=Tq, Tk=Tk, order=2)
    pad = make_padding(2, Tk) if padded else None
    check_against_reference(inputs, 1e-5, 2e-5, causal=causal, key_padding=pad)


def test_output_in_the_callers_layout(monkeypatch, small_blocks):
    """The output is a (B, H, T, D) view of a (B, T, H, D)-contiguous tensor: merging the heads is free."""
    monkeypatch.setattr(kernel, "OUTPUT_IN_CALLER_LAYOUT", True)
    q, k, v, ranges, ts = make_inputs(Tq=19, Tk=37, order=2)
    out = multimax_attention(q, k, v, ranges, ts)
    assert out.shape == (2, 2, 19, 32) and out.transpose(1, 2).is_contiguous()
    merged = out.transpose(1, 2).reshape(2, 19, 64)
    assert merged.data_ptr() == out.data_ptr()
    want = reference(q, k, v, ranges, ts).transpose(1, 2).reshape(2, 19, 64)
    assert_close(merged, want, 1e-5, "merged heads")


@pytest.mark.parametrize("switch", [None, *SWITCHES])
def test_parameter_grads_are_deterministic(small_blocks, monkeypatch, switch):
    if switch is not None:
        flip(monkeypatch, switch)
    q, k, v, ranges, ts = make_inputs(Tq=37, Tk=37, order=2)
    pad = make_padding(2, 37)
    results = []
    for _ in range(2):
        ranges.grad = ts.grad = None
        multimax_attention(q, k, v, ranges, ts, causal=True, key_padding=pad).sum().backward()
        results.append((ranges.grad.clone(), ts.grad.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    _, ref_grads = run(reference, (q, k, v, ranges, ts), torch.ones(2, 2, 37, 32), causal=True, key_padding=pad)
    assert_close(results[0][0], ref_grads[3], 1e-4, "grad ranges")
    assert_close(results[0][1], ref_grads[4], 1e-4, "grad ts")


@pytest.mark.parametrize("which", ["ranges", "ts"])
def test_only_sigma_params_require_grad(small_blocks, which):
    """Frozen q, k, v (and one frozen parameter): only the wanted gradient is returned."""
    q, k, v, ranges, ts = make_inputs(Tq=19, Tk=37, order=1)
    q, k, v = q.detach(), k.detach(), v.detach()
    (ts if which == "ranges" else ranges).requires_grad_(False)
    check_against_reference((q, k, v, ranges, ts), 1e-5, 2e-5, causal=True)
    out, grads = run(multimax_attention, (q, k, v, ranges, ts), torch.ones(2, 2, 19, 32), causal=True)
    assert (grads[3] is None) == (which == "ts") and (grads[4] is None) == (which == "ranges")


def test_non_contiguous_inputs(small_blocks):
    """q, k, v sliced out of a permuted qkv projection, strided padding, strided output grad."""
    B, T, H, D = 2, 37, 2, 32
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, T, 3, H, D, generator=gen).permute(2, 0, 3, 1, 4)  # (3, B, H, T, D) view
    q, k, v = (t.requires_grad_() for t in qkv.unbind(0))
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    pad = make_padding(B, T).t().contiguous().t()  # (B, T) with strides (1, B)
    assert not pad.is_contiguous()
    ranges, ts = torch.tensor(RANGES[2], requires_grad=True), torch.tensor(TS[2], requires_grad=True)
    # an output grad that is a transposed view, as after out.transpose(1, 2).reshape(B, T, H * D)
    grad_out = torch.randn(B, T, H, D, generator=gen).transpose(1, 2)
    out, grads = run(multimax_attention, (q, k, v, ranges, ts), grad_out, causal=True, key_padding=pad)
    ref_out, ref_grads = run(reference, (q, k, v, ranges, ts), grad_out, causal=True, key_padding=pad)
    assert_close(out, ref_out, 1e-5, "output")
    for name, g, ref_g in zip(("q", "k", "v", "ranges", "ts"), grads, ref_grads):
        assert_close(g, ref_g, 1e-4 if name in ("ranges", "ts") else 2e-5, f"grad {name}")


def test_keys_and_values_with_different_layouts(small_blocks):
    """k contiguous, v a transposed view (as from a projection stored (B, H, D, T)): each tensor is
    read through its own strides, in the forward and both backward kernels."""
    q, k, _, ranges, ts = make_inputs(Tq=19, Tk=37, order=2)
    v = torch.randn(2, 2, 32, 37, generator=torch.Generator().manual_seed(2)).transpose(-2, -1).requires_grad_()
    assert k.stride() != v.stride()
    check_against_reference((q, k, v, ranges, ts), 1e-5, 2e-5, causal=True, key_padding=make_padding(2, 37))


def _bad(**changes):
    """Keyword arguments of a valid call with some of them replaced."""
    q, k, v = torch.zeros(2, 2, 5, 16), torch.zeros(2, 2, 7, 16), torch.zeros(2, 2, 7, 16)
    args = dict(q=q, k=k, v=v, ranges=torch.zeros(2), ts=torch.zeros(2), key_padding=None)
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "args, match",
    [
        (_bad(q=torch.zeros(2, 5, 16)), "4-D"),
        (_bad(k=torch.zeros(3, 2, 7, 16), v=torch.zeros(3, 2, 7, 16)), "does not match"),
        (_bad(q=torch.zeros(2, 3, 5, 16)), "key/value heads must divide the query heads"),
        (_bad(v=torch.zeros(2, 2, 6, 16)), "same shape"),
        (_bad(q=torch.zeros(2, 2, 5, 48), k=torch.zeros(2, 2, 7, 48), v=torch.zeros(2, 2, 7, 48)), "head dim D=48"),
        (_bad(v=torch.zeros(2, 2, 7, 16, dtype=torch.float16)), "share a dtype"),
        (
            _bad(
                q=torch.zeros(2, 2, 5, 16).double(),
                k=torch.zeros(2, 2, 7, 16).double(),
                v=torch.zeros(2, 2, 7, 16).double(),
            ),
            "not supported",
        ),
        (_bad(q=torch.zeros(2, 2, 0, 16)), "empty"),
        (_bad(key_padding=torch.ones(2, 5, dtype=torch.bool)), r"shape \(B, Tk\)"),
        (_bad(key_padding=torch.ones(2, 7)), "bool tensor"),
        (_bad(ranges=torch.zeros(3), ts=torch.zeros(3)), r"shape \(2,\) or \(4,\)"),
        (_bad(ranges=torch.zeros(2), ts=torch.zeros(4)), r"shape \(2,\) or \(4,\)"),
        (_bad(ts=None), "both ranges and ts"),
    ],
)
def test_bad_inputs_raise_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        multimax_attention(**args)


def test_bad_scale_raises():
    q = torch.zeros(1, 1, 4, 16)
    with pytest.raises(ValueError, match="scale must be finite"):
        multimax_attention(q, q, q, scale=float("nan"))
