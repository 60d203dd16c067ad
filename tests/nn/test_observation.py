"""The attention observation point: recorded weights equal a hand computation for the three model
kinds, recording does not change the output, masks can be edited, and the fused path is untouched
outside the context."""

import pytest
import torch

from mmlight.models import ReweightedViT
from mmlight.models.transformer import TransformerLM, TransformerSeq2Seq
from mmlight.nn import AttentionObserver, AttentionSite, attention, observe_attention, record_attention
from mmlight.reweighting import ReweightingSpec, build, multimax_sigma
from mmlight.reweighting.fused import SigmaKernels
from tests.helpers.models import micro_vit, tiny

PAD = 1


def tiny_model(cls, n_layers=2, n_encoder_layers=0):
    """``cls`` (``TransformerLM``, ``TransformerSeq2Seq``) of test_transformer's ``tiny`` config without dropout,
    in eval mode."""
    return cls(tiny(n_encoder_layers, n_layers=n_layers, dropout=0.0)).eval()


def hand_softmax(q, k, keep, sigma=lambda s: s):
    """softmax(sigma(q k^T / sqrt(d))) over kept keys, in float64, written out: exp / sum."""
    scores = sigma((q.double() @ k.double().transpose(-2, -1)) / q.shape[-1] ** 0.5)
    scores = scores - scores.masked_fill(~keep, -1e300).amax(-1, keepdim=True)
    e = scores.exp() * keep
    return e / e.sum(-1, keepdim=True).clamp_min(1e-300)


def run_with_and_without_recording(model, modules, *inputs):
    """Run ``model(*inputs)`` plainly and under :func:`record_attention`; check the outputs agree.
    Returns the recording and each of ``modules``' inputs (positional, keyword) by name."""
    seen, handles = {}, []
    for name, m in modules.items():

        def hook(module, args, kwargs, name=name):
            seen[name] = (args, kwargs)

        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    plain = model(*inputs)
    with record_attention(model) as rec:
        recorded = model(*inputs)
    for h in handles:
        h.remove()
    torch.testing.assert_close(recorded, plain, atol=1e-5, rtol=1e-5)
    return rec, seen


def test_vit_records_every_block_as_computed_by_hand():
    torch.manual_seed(0)
    config = micro_vit(attention=ReweightingSpec("multimax"), drop_path_rate=0.0, backend="reference")
    model = ReweightedViT(config).eval()
    with torch.no_grad():
        for m in (site.module for site in model.attention_sites().values()):
            m.ranges.copy_(torch.tensor([-0.5, 0.6, -1.0, 1.2]))
            m.ts.copy_(torch.tensor([0.3, -0.25, 0.1, 0.05]))
    images = torch.randn(3, 1, 8, 8)
    attns = {f"blocks.{i}": b.attn for i, b in enumerate(model.vit.blocks)}
    rec, seen = run_with_and_without_recording(model, attns, images)
    assert rec.sites() == list(attns)
    for name, attn in attns.items():
        (x,), _ = seen[name]
        B, N, C = x.shape
        q, k, _ = attn.qkv(x).reshape(B, N, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        m = attn.reweight
        want = hand_softmax(
            q, k, torch.ones(N, N, dtype=torch.bool), lambda s: multimax_sigma(s, m.ranges.double(), m.ts.double())
        )
        [(weights, keep)] = rec[name]
        assert weights.shape == (3, 4, 16, 16) and keep is None
        torch.testing.assert_close(weights.double(), want, atol=1e-5, rtol=1e-4)


def test_lm_records_causal_weights_and_one_call_per_decoding_step():
    torch.manual_seed(0)
    model = tiny_model(TransformerLM)
    tokens = torch.randint(2, 23, (2, 7))
    attns = {f"decoder.layers.{i}.self_attn": layer.self_attn for i, layer in enumerate(model.decoder.layers)}
    rec, seen = run_with_and_without_recording(model, attns, tokens)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    for name, attn in attns.items():
        (x,), _ = seen[name]
        want = hand_softmax(attn._heads(attn.q_proj(x)), attn._heads(attn.k_proj(x)), causal)
        [(weights, keep)] = rec[name]
        torch.testing.assert_close(weights.double(), want, atol=1e-5, rtol=1e-4)
        assert (weights[..., ~causal] == 0).all()
        assert torch.equal(keep.expand(2, 2, 7, 7), causal.expand(2, 2, 7, 7))  # the mask used, causal folded in
        assert not weights.requires_grad  # recorded detached, though the model's parameters require grad
        site = model.attention_sites()[name]
        assert (rec.site(name).name, rec.site(name).kind, rec.site(name).layer) == (name, "decoder_self", site.layer)
        assert rec.site(name).module is attn.reweight

    # Incremental decoding: one record per step; the last step's row is the full pass's last row.
    cache = model.new_cache()
    with record_attention(model) as steps:
        for t in range(7):
            model(tokens[:, t : t + 1], cache=cache)
    calls = steps["decoder.layers.1.self_attn"]
    assert len(calls) == 7 and calls[-1].weights.shape == (2, 2, 1, 7)
    torch.testing.assert_close(
        calls[-1].weights[:, :, 0], rec["decoder.layers.1.self_attn"][0].weights[:, :, -1], atol=1e-5, rtol=1e-4
    )


def test_seq2seq_records_encoder_decoder_and_cross_attention_with_padding():
    torch.manual_seed(0)
    model = tiny_model(TransformerSeq2Seq, n_encoder_layers=2)
    src, tgt = torch.randint(2, 23, (2, 6)), torch.randint(2, 23, (2, 5))
    src[1, 4:] = PAD  # the second source is 4 tokens long
    site = "decoder.layers.1.cross_attn"
    rec, seen = run_with_and_without_recording(
        model, {site: model.decoder.layers[1].cross_attn, "enc": model.encoder.layers[0].self_attn}, src, tgt
    )
    assert set(rec.sites()) == set(model.attention_sites())
    src_keep = (src != PAD)[:, None, None, :]  # (B, 1, 1, S)

    attn = model.decoder.layers[1].cross_attn
    (x, memory), kwargs = seen[site]
    want = hand_softmax(attn._heads(attn.q_proj(x)), attn._heads(attn.k_proj(memory)), src_keep)
    torch.testing.assert_close(rec[site][0].weights.double(), want, atol=1e-5, rtol=1e-4)
    assert (rec[site][0].weights[1, ..., 4:] == 0).all()
    assert torch.equal(rec[site][0].keep.expand(2, 1, 5, 6), src_keep.expand(2, 1, 5, 6))

    enc = model.encoder.layers[0].self_attn
    (x,), _ = seen["enc"]
    want = hand_softmax(enc._heads(enc.q_proj(x)), enc._heads(enc.k_proj(x)), src_keep)
    torch.testing.assert_close(rec["encoder.layers.0.self_attn"][0].weights.double(), want, atol=1e-5, rtol=1e-4)


class DropFirstKey(AttentionObserver):
    """Masks key 0 for every query of one site; counts the calls it saw."""

    def __init__(self, site):
        self.site, self.sites_seen = site, []

    def edit_mask(self, site, q, k, mask):
        self.sites_seen.append((site.name, site.kind, site.layer))
        if site.name != self.site:
            return mask
        keep = torch.ones(k.shape[-2], dtype=torch.bool, device=k.device)
        keep[0] = False
        return keep if mask is None else mask & keep

    def record(self, site, weights, keep):
        if site.name == self.site:
            self.weights = weights


def test_an_observer_can_narrow_the_mask():
    torch.manual_seed(0)
    model = tiny_model(TransformerLM)
    tokens = torch.randint(2, 23, (2, 6))
    observer = DropFirstKey("decoder.layers.1.self_attn")
    with observe_attention(model, observer):
        edited = model(tokens)
    assert observer.sites_seen == [
        ("decoder.layers.0.self_attn", "decoder_self", 0),
        ("decoder.layers.1.self_attn", "decoder_self", 1),
    ]
    assert (observer.weights[..., 0] == 0).all()
    assert observer.weights[:, :, 0].sum() == 0  # query 0 saw only key 0: now an empty row
    torch.testing.assert_close(observer.weights[:, :, 1:].sum(-1), torch.ones(2, 2, 5))
    assert not torch.allclose(edited, model(tokens))


def test_fused_path_is_taken_outside_the_context_only(monkeypatch):
    """On the triton backend the fused attention kernel runs outside the context; inside, the
    explicit path runs, and the two outputs agree within kernel tolerance (interpreter on the CPU)."""
    calls = []
    original = SigmaKernels.attention

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SigmaKernels, "attention", counting)
    config = micro_vit(attention=ReweightingSpec("multimax"), drop_path_rate=0.0, backend="triton")
    model = ReweightedViT(config).eval()
    images = torch.randn(2, 1, 8, 8)
    fused = model(images)
    assert len(calls) == 4
    with record_attention(model) as rec:
        observed = model(images)
    assert len(calls) == 4 and len(rec.sites()) == 4
    torch.testing.assert_close(observed, fused, atol=1e-5, rtol=1e-4)


def test_unknown_model_is_refused_and_other_modules_pass_through():
    refusal = r"^Linear names no attention sites \(no attention_sites\(\) on it or its \.model\)$"
    with pytest.raises(TypeError, match=refusal):
        with record_attention(torch.nn.Linear(2, 2)):
            pass
    # A reweighting module that is not a site of the observed model is not recorded.
    model = tiny_model(TransformerLM, n_layers=1)
    q = k = v = torch.randn(1, 2, 3, 4)
    with record_attention(model) as rec:
        attention(q, k, v, build("softmax"))
    assert rec.sites() == []


class Net(torch.nn.Module):
    """A network of one attention site, ``only``, whose reweighting module is ``module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def attention_sites(self):
        return {"only": AttentionSite("only", "self", "tokens", 0, self.module)}


class Task(torch.nn.Module):
    """A task holding its network as ``.model``."""

    def __init__(self, model):
        super().__init__()
        self.model = model


def test_observed_dropout_drops_the_weights_after_they_are_recorded():
    """Under observation too, dropout acts on the weights (the same draws as by hand), and the record is
    of the weights before dropout."""
    fn = build("multimax", backend="reference").double()
    with torch.no_grad():
        fn.ts.zero_()  # MultiMax with zero slopes: softmax
    q, k, v = torch.randn(3, 2, 3, 4, 5, dtype=torch.float64).unbind(0)
    probs = torch.softmax(q @ k.transpose(-2, -1) / 5**0.5, -1)
    with record_attention(Task(Net(fn))) as rec:
        torch.manual_seed(0)
        got = attention(q, k, v, fn, dropout_p=0.3)
    torch.manual_seed(0)
    torch.testing.assert_close(got, torch.nn.functional.dropout(probs, p=0.3, training=True) @ v)
    [(weights, keep)] = rec["only"]
    torch.testing.assert_close(weights, probs)
    assert keep is None


def test_observation_ends_with_its_context_even_on_an_error():
    fn = build("softmax")
    net = Net(fn)
    q = k = v = torch.randn(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="stop"):
        with record_attention(net) as rec:
            attention(q, k, v, fn)
            raise RuntimeError("stop")
    attention(q, k, v, fn)  # after the context: not recorded
    assert rec.sites() == ["only"] and len(rec["only"]) == 1
    with record_attention(net) as outer:
        with record_attention(net) as inner:
            attention(q, k, v, fn)
        attention(q, k, v, fn)  # the inner context is gone, the outer one sees it again
    assert len(inner["only"]) == 1 and len(outer["only"]) == 1


class Seen(AttentionObserver):
    """Keeps what :meth:`edit_mask` was given."""

    def edit_mask(self, site, q, k, mask):
        self.given = (site, q, k, mask)
        return mask


def test_an_observer_is_given_the_calls_queries_keys_and_causal_mask_and_its_backend_is_kept(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn: compiled.append(fn) or fn)
    fn = build("multimax", backend="compile")
    net, observer = Net(fn), Seen()
    q, (k, v) = torch.randn(2, 2, 2, 5), torch.randn(2, 2, 2, 4, 5).unbind(0)  # 2 queries, 4 keys
    padding = torch.tensor([[True] * 4, [True, True, False, False]])[:, None, None, :]  # (B, 1, 1, Tk)
    with observe_attention(net, observer):
        got = attention(q, k, v, fn, mask=padding, is_causal=True)
    site, q_seen, k_seen, mask = observer.given
    assert site.name == "only" and q_seen is q and k_seen is k
    causal = torch.ones(2, 4, dtype=torch.bool).tril(2)  # bottom-right: 2 queries, 4 keys
    assert torch.equal(mask, padding & causal)
    assert len(compiled) == 1  # the weights were computed on the module's backend
    torch.testing.assert_close(got, attention(q, k, v, fn, mask=padding, is_causal=True, backend="reference"))


def test_observation_works_on_the_inputs_device():
    meta = torch.device("meta")
    fn = build("multimax").to(meta)
    q = torch.empty(1, 2, 3, 4, device=meta)
    with record_attention(Net(fn)) as rec:
        out = attention(q, q, q, fn, is_causal=True)
    assert out.device == meta and rec["only"][0].keep.device == meta
