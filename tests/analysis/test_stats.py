"""collect_statistics on tiny models of the three kinds against computations from weights recorded
with record_attention and masks built here, independently of the observer."""

import itertools
import math

import numpy as np
import pytest
import torch

from mmlight.analysis.stats import collect_statistics, metric_rows
from mmlight.nn.attention import record_attention
from mmlight.nn.sites import AttentionSite
from mmlight.reweighting import ReweightingSpec, Softmax
from mmlight.tasks import ImageClassifier, LanguageModel, Translator
from tests.helpers.models import micro_vit, tiny_transformer

PAD = 1


def manual_entropy_per_head(weights, keep, query_ok):
    """Mean entropy per head over real queries, by a loop."""
    B, H, Tq, _ = weights.shape
    out = []
    for h in range(H):
        values = []
        for b in range(B):
            for q in range(Tq):
                if query_ok[b, q] and keep[b, q].any():
                    p = weights[b, h, q][keep[b, q]].double()
                    values.append(float(-(p[p > 0] * p[p > 0].log()).sum()))
        out.append(sum(values) / len(values))
    return out


def test_lm_statistics_skip_padding_and_future_keys():
    torch.manual_seed(0)
    task = LanguageModel(model=tiny_transformer(attention=ReweightingSpec("sparsemax")))
    tokens = torch.randint(2, 20, (3, 9))
    tokens[1, 6:] = PAD
    tokens[2, 3:] = PAD
    stats = collect_statistics(task, [{"input": tokens}])
    with record_attention(task) as recorder:
        task.model.eval()
        task.model(tokens)
    real = tokens != PAD
    keep = torch.ones(9, 9, dtype=torch.bool).tril()[None] & real[:, None, :]  # (B, Tq, Tk)
    for site in ("decoder.layers.0.self_attn", "decoder.layers.1.self_attn"):
        weights = recorder[site][0].weights
        assert (weights[~keep[:, None].expand_as(weights)] == 0).all()
        want = manual_entropy_per_head(weights, keep, real)
        assert stats["sites"][site]["heads"]["entropy"] == pytest.approx(want, rel=1e-6)
        counted = keep[:, None].expand_as(weights) & real[:, None, :, None]
        zero = (weights[counted] == 0).double().mean().item()
        assert stats["sites"][site]["metrics"]["frac_zero"] == pytest.approx(zero)
        assert stats["sites"][site]["metrics"]["frac_below_1e-3"] == pytest.approx(
            (weights[counted] < 1e-3).double().mean().item()
        )
        assert sum(stats["sites"][site]["histogram"]) == counted.sum().item()


def test_translation_reports_encoder_decoder_and_cross_attention_separately():
    torch.manual_seed(0)
    task = Translator(model=tiny_transformer(n_encoder_layers=2))
    src = torch.randint(2, 20, (2, 7))
    src[1, 5:] = PAD
    tgt = torch.randint(2, 20, (2, 6))
    tgt[0, 4:] = PAD
    batch = {"src": src, "src_mask": src != PAD, "tgt_in": tgt}
    stats = collect_statistics(task, [batch])
    kinds = {site: entry["kind"] for site, entry in stats["sites"].items()}
    assert kinds["encoder.layers.0.self_attn"] == "encoder_self"
    assert kinds["decoder.layers.1.self_attn"] == "decoder_self"
    assert kinds["decoder.layers.0.cross_attn"] == "cross"
    assert stats["sites"]["decoder.layers.0.cross_attn"]["metrics"]["rollout_discrepancy"] is None
    with record_attention(task) as recorder:
        task.model.eval()
        task.model(src, tgt, src != PAD)
    weights = recorder["decoder.layers.1.cross_attn"][0].weights
    keep = (src != PAD)[:, None, :].expand(2, 6, 7)
    want = manual_entropy_per_head(weights, keep, tgt != PAD)
    assert stats["sites"]["decoder.layers.1.cross_attn"]["heads"]["entropy"] == pytest.approx(want, rel=1e-6)
    # incoming attention counts only real source keys: padded positions are NaN -> None
    incoming = stats["sites"]["encoder.layers.0.self_attn"]["incoming_mean"]
    assert all(v is not None for v in incoming)  # every source position is real in sample 0
    rows = metric_rows(stats)
    assert {r[2] for r in rows} >= {"entropy", "token_similarity", "sink_ratio", "rollout_discrepancy"}


def test_vit_token_similarity_and_rollout_against_a_manual_pass():
    torch.manual_seed(0)
    task = ImageClassifier(model=micro_vit(global_pool="token"))
    task.eval()
    images = torch.randn(3, 1, 8, 8)
    stats = collect_statistics(task, [(images, torch.zeros(3, dtype=torch.long))])
    vit = task.model.vit
    with torch.no_grad(), record_attention(task) as recorder:
        x = vit.norm_pre(vit._pos_embed(vit.patch_embed(images)))
        for i, block in enumerate(vit.blocks):
            x = block(x)
            patches = torch.nn.functional.normalize(x[:, 1:].double(), dim=-1)  # CLS dropped
            gram = patches @ patches.transpose(1, 2)
            n = patches.shape[1]
            want = ((gram.sum((1, 2)) - n) / (n * (n - 1))).mean().item()
            assert stats["blocks"][f"blocks.{i}"]["token_similarity"] == pytest.approx(want, rel=1e-6)
    rolled = torch.eye(17, dtype=torch.float64)
    for i in range(4):
        a = recorder[f"blocks.{i}"][0].weights.double().mean(1)  # (B, N, N)
        a_hat = 0.5 * a + 0.5 * torch.eye(17, dtype=torch.float64)
        rolled = a_hat @ rolled  # rows of Â already sum to 1
        want = (0.5 * (rolled - a).abs().sum(-1)).mean().item()
        assert stats["sites"][f"blocks.{i}"]["metrics"]["rollout_discrepancy"] == pytest.approx(want, rel=1e-6)


def test_statistics_leave_attention_unobserved_afterwards():
    import importlib

    attn_module = importlib.import_module("mmlight.nn.attention")  # the module, not the function

    task = LanguageModel(model=tiny_transformer())
    samples = []
    collect_statistics(
        task,
        [{"input": torch.randint(2, 20, (2, 5))}, {"input": torch.randint(2, 20, (3, 5))}],
        progress=samples.append,
    )
    assert attn_module._OBSERVED.get() is None
    assert task.model.training  # the mode is restored
    assert samples == [2, 3]  # the progress bar advances by each batch's samples


def test_deferred_reduction_gives_the_same_statistics_and_keeps_memory_bounded():
    """record_statistics may leave the reduction for later (the training callback finishes it on a
    background thread): the result equals the batch-by-batch one, and past keep_bytes it reduces at once."""
    from mmlight.analysis.stats import record_statistics

    torch.manual_seed(0)
    task = LanguageModel(model=tiny_transformer(n_layers=3))
    batches = [{"input": torch.randint(2, 20, (4, 9))}, {"input": torch.randint(2, 20, (3, 7))}]
    want = collect_statistics(task, batches)

    deferred = record_statistics(task, batches, keep_bytes=2**30)
    assert deferred.observer.sites == {}  # nothing reduced yet: 3 layers x 2 batches kept
    assert sum(call is not None for call in deferred.observer._kept) == 6
    # weights (float32) and scores (float32) of (4, 2, 9, 9) and (3, 2, 7, 7) per layer, plus the bool masks
    assert deferred.observer.kept_bytes >= 3 * 2 * 4 * (4 * 2 * 81 + 3 * 2 * 49)
    assert deferred.blocks == want["blocks"]  # token similarity is done during the forward pass
    assert deferred.finish() == want

    bounded = record_statistics(task, batches, keep_bytes=1000)  # less than one layer's weights
    assert bounded.observer.kept_bytes <= 1000 and len(bounded.observer.sites) == 3
    assert bounded.finish() == want


# ---- StatsObserver and summarize on hand-made attention calls, against loops over the rows ----

ENC, DEC9, DEC10, CROSS = (
    "encoder.layers.0.self_attn",
    "decoder.layers.9.self_attn",
    "decoder.layers.10.self_attn",
    "decoder.layers.9.cross_attn",
)
#: The records a model would give these sites (and three ViT blocks): what the observer is called with.
SITES = {
    ENC: AttentionSite(ENC, "encoder_self", "encoder", 0, Softmax()),
    DEC9: AttentionSite(DEC9, "decoder_self", "decoder", 9, Softmax()),
    DEC10: AttentionSite(DEC10, "decoder_self", "decoder", 10, Softmax()),
    CROSS: AttentionSite(CROSS, "cross", "decoder", 9, Softmax(), key_stack="encoder"),
    **{f"blocks.{i}": AttentionSite(f"blocks.{i}", "self", "blocks", i, Softmax()) for i in (0, 2, 10)},
}


def synthetic_batch(gen, t_enc, t_dec, enc_real, dec_real):
    """One batch of hand-made attention calls of a 2-sample, 2-head encoder-decoder: ``(site, q, k, keep,
    weights)`` per call in model order, and the real query positions per stack. Keys are masked per head
    (head 1 also loses key 1 everywhere, so some rows count for head 0 only); weights are random on the
    kept keys with some exact zeros, zero elsewhere."""
    B, H, hs = 2, 2, 3
    enc_real, dec_real = torch.tensor(enc_real, dtype=torch.bool), torch.tensor(dec_real, dtype=torch.bool)

    def call(site, tq, tk, keep):
        keep = keep.clone()
        keep[:, 1, :, 1] = False
        w = torch.rand(B, H, tq, tk, generator=gen, dtype=torch.float64) ** 3
        w[torch.rand(B, H, tq, tk, generator=gen) < 0.2] = 0.0
        w[..., 0] += 1e-12  # every row with key 0 kept has a nonzero weight
        w = torch.where(keep, w, 0.0)
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-300)
        q = torch.randn(B, H, tq, hs, generator=gen, dtype=torch.float64)
        k = torch.randn(B, H, tk, hs, generator=gen, dtype=torch.float64)
        return site, q, k, keep, w

    causal = torch.ones(t_dec, t_dec, dtype=torch.bool).tril()
    enc_keep = enc_real[:, None, None, :].expand(B, H, t_enc, t_enc)
    dec_keep = (causal & dec_real[:, None, :])[:, None].expand(B, H, t_dec, t_dec)
    cross_keep = enc_real[:, None, None, :].expand(B, H, t_dec, t_enc)
    calls = [
        call(ENC, t_enc, t_enc, enc_keep),
        call(DEC9, t_dec, t_dec, dec_keep),
        call(CROSS, t_dec, t_enc, cross_keep),
        call(DEC10, t_dec, t_dec, dec_keep),
    ]
    return calls, {"encoder": enc_real, "decoder": dec_real}


def synthetic_batches():
    gen = torch.Generator().manual_seed(3)
    # batch 1: encoder position 3 is padding in both samples (never attended), decoder sample 1 has one
    # real token; batch 2 is longer on the decoder side and shorter on the encoder side
    return [
        synthetic_batch(gen, 4, 3, [[1, 1, 1, 0], [1, 1, 0, 0]], [[1, 1, 1], [1, 0, 0]]),
        synthetic_batch(gen, 3, 5, [[1, 1, 1], [1, 1, 1]], [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
    ]


def observe(settings, batches):
    """Feed the calls to a StatsObserver the way attention does (edit_mask, then record) and summarise."""
    from mmlight.analysis.stats import StatsObserver, summarize

    observer = StatsObserver(settings)
    for calls, real in batches:
        observer.query_keep = real
        for site, q, k, keep, w in calls:
            assert observer.edit_mask(SITES[site], q, k, keep) is keep  # the observer never changes the mask
            observer.record(SITES[site], w, keep)
        observer.end_batch()
    observer.flush()
    return summarize(observer, {"decoder.layers.9": {"token_similarity": 0.25}})


def reference_statistics(settings, batches):
    """Every per-site statistic by plain loops over (sample, head, query) rows in NumPy float64."""
    from tests.helpers.references import naive_m_and_s

    edges = np.logspace(-8, 0, 33)
    per_site, rollout_tv = {}, {}
    for calls, real in batches:
        head_means = {}
        for site, q, k, keep, w in calls:
            stack = site.split(".")[0]
            ref = per_site.setdefault(site, {"rows": {}, "entries": {}, "values": [], "incoming": {}, "Tk": 0})
            q, k, keep, w = q.numpy(), k.numpy(), keep.numpy(), w.numpy()
            ref["Tk"] = max(ref["Tk"], w.shape[-1])
            x_all = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
            B, H, Tq, Tk = w.shape
            counted_any = np.zeros((B, Tq), dtype=bool)
            for b, h, i in itertools.product(range(B), range(H), range(Tq)):
                kept = keep[b, h, i]
                n = int(kept.sum())
                if not real[stack][b, i] or n == 0:
                    continue
                counted_any[b, i] = True
                p, x = w[b, h, i], x_all[b, h, i]
                mass = p.sum()
                row = {
                    "max_weight": p.max(),
                    "null_mass": 1 - mass,
                    "frac_zero_mass": float(mass <= settings.zero_mass),
                }
                if mass > settings.zero_mass:  # the shape of the distribution, on the renormalised weights
                    ent = -sum(v / mass * math.log(v / mass) for v in p if v > 0)
                    m, s = naive_m_and_s(x, p / mass, kept, settings.eps_multimodality, settings.eps_sparsity)
                    row.update(
                        {
                            "entropy": ent,
                            "normalized_entropy": ent / math.log(n) if n >= 2 else math.nan,
                            "multimodality": m,
                            "sparsity": s,
                        }
                    )
                for metric, value in row.items():
                    ref["rows"].setdefault(metric, {0: [], 1: []})[h].append(value)
                for j in np.flatnonzero(kept):
                    ref["entries"].setdefault(h, []).append(p[j])
                    ref["values"].append(p[j])
                    raw, rel, seen = ref["incoming"].get(j, (0.0, 0.0, 0))
                    ref["incoming"][j] = (raw + p[j], rel + p[j] * n, seen + 1)
            if "cross" not in site:
                head_means.setdefault(stack, []).append((site, w.mean(1), counted_any))
        for _stack, layers in head_means.items():  # rollout in layer order, per batch
            rolled = None
            for site, a, rows in sorted(layers, key=lambda t: int(t[0].split(".")[2])):
                a_hat = (a + np.eye(a.shape[-1])) / (a.sum(-1, keepdims=True) + 1)
                rolled = a_hat if rolled is None else a_hat @ rolled
                tv = 0.5 * np.abs(rolled - a).sum(-1)
                total, n = rollout_tv.get(site, (0.0, 0))
                rollout_tv[site] = (total + tv[rows].sum(), n + int(rows.sum()))

    want = {}
    for site, ref in per_site.items():
        heads, metrics = {}, {}
        for metric, by_head in ref["rows"].items():
            ok = {h: [v for v in vals if not math.isnan(v)] for h, vals in by_head.items()}
            heads[metric] = [sum(ok[h]) / len(ok[h]) if ok[h] else None for h in (0, 1)]
            pooled = ok[0] + ok[1]
            metrics[metric] = sum(pooled) / len(pooled) if pooled else None
        for metric, hit in (("frac_below_1e-3", lambda v: v < settings.near_zero), ("frac_zero", lambda v: v == 0)):
            heads[metric] = [np.mean([hit(v) for v in ref["entries"][h]]) for h in (0, 1)]
            pooled = ref["entries"][0] + ref["entries"][1]
            metrics[metric] = np.mean([hit(v) for v in pooled])
        values = np.array(ref["values"])
        histogram = [int((values < 1e-8).sum()), *np.histogram(values[values >= 1e-8], bins=edges)[0].tolist()]
        positions = ref["Tk"]  # the longest key length seen; unattended positions are None
        raw = [
            ref["incoming"][j][0] / ref["incoming"][j][2] if j in ref["incoming"] else None for j in range(positions)
        ]
        rel = [
            ref["incoming"][j][1] / ref["incoming"][j][2] if j in ref["incoming"] else None for j in range(positions)
        ]
        known = [j for j in range(positions) if rel[j] is not None]
        metrics["sink_ratio"] = sum(rel[j] > settings.sink_eps for j in known) / len(known)
        total, n = rollout_tv.get(site, (0.0, 0))
        metrics["rollout_discrepancy"] = total / n if n else None
        metrics["zero_mass_rows"] = int(sum(sum(by_head) for by_head in ref["rows"]["frac_zero_mass"].values()))
        top = sorted(known, key=lambda j: -rel[j])[: settings.top_sinks]
        want[site] = {
            "heads": heads,
            "metrics": metrics,
            "histogram": histogram,
            "incoming_mean": raw,
            "incoming_relative": rel,
            "top_sinks": [(j, rel[j]) for j in top],
        }
    return want


def close(got, want):
    """Equal up to float64 rounding, None where the reference has None (nested lists and dicts)."""
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(close(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(close(g, w) for g, w in zip(got, want))
    if want is None:
        return got is None
    return got is not None and got == pytest.approx(float(want), rel=1e-9, abs=1e-15)


def test_observer_statistics_of_hand_made_calls_equal_loops_over_the_rows():
    """Every statistic of summarize() for an encoder-decoder with padding, per-head masks, causal rows, a
    one-key row, layers 9 and 10 (rolled out in numeric, not text, order) and batches of different lengths,
    at thresholds other than the defaults, against reference_statistics' loops (the sums accumulate over
    both batches; top_sinks=3 cuts the 4 and 5 positions)."""
    from mmlight.analysis.stats import Settings

    settings = Settings(eps_multimodality=0.1, eps_sparsity=-0.1, near_zero=0.05, sink_eps=1.0, top_sinks=3)
    batches = synthetic_batches()
    stats = observe(settings, batches)
    want = reference_statistics(settings, batches)
    assert stats["settings"] == {
        "eps_multimodality": 0.1,
        "eps_sparsity": -0.1,
        "near_zero": 0.05,
        "sink_eps": 1.0,
        "top_sinks": 3,
        "zero_mass": 1e-9,
        "low_gate": 0.1,
    }
    assert stats["histogram_edges"] == pytest.approx(np.logspace(-8, 0, 33).tolist(), rel=1e-12)
    assert stats["blocks"] == {"decoder.layers.9": {"token_similarity": 0.25}}
    # ordered by stack, kind, then layer number
    assert list(stats["sites"]) == [CROSS, DEC9, DEC10, ENC]
    assert [(stats["sites"][s]["kind"], stats["sites"][s]["layer"]) for s in stats["sites"]] == [
        ("cross", 9),
        ("decoder_self", 9),
        ("decoder_self", 10),
        ("encoder_self", 0),
    ]
    for site, entry in stats["sites"].items():
        ref = want[site]
        assert set(entry["heads"]) == set(HEAD_METRICS_REF) and close(entry["heads"], ref["heads"]), site
        layer_only = {"sink_ratio", "rollout_discrepancy", "zero_mass_rows"}
        assert entry["metrics"].keys() == set(HEAD_METRICS_REF) | layer_only
        assert close(entry["metrics"], ref["metrics"]), site
        assert entry["histogram"] == ref["histogram"], site
        assert close(entry["incoming_mean"], ref["incoming_mean"]), site
        assert close(entry["incoming_relative"], ref["incoming_relative"]), site
        assert close([(t["position"], t["relative"]) for t in entry["top_sinks"]], ref["top_sinks"]), site
    # what the reference found is not degenerate: real rollouts, a NaN position, both sides of sink_eps
    assert stats["sites"][CROSS]["metrics"]["rollout_discrepancy"] is None
    assert stats["sites"][DEC10]["metrics"]["rollout_discrepancy"] > 0
    # (the unseen position 3 of the encoder ranks below positions 0..2, one of which is below 1)
    assert stats["sites"][ENC]["incoming_mean"][3] is None and len(stats["sites"][ENC]["top_sinks"]) == 3
    assert min(stats["sites"][ENC]["incoming_relative"][:3]) < 1
    assert len(stats["sites"][DEC9]["top_sinks"]) == 3 and len(stats["sites"][DEC9]["incoming_mean"]) == 5
    assert all(0 < stats["sites"][s]["metrics"]["sink_ratio"] < 1 for s in stats["sites"])


HEAD_METRICS_REF = (
    "entropy",
    "normalized_entropy",
    "multimodality",
    "sparsity",
    "frac_below_1e-3",
    "frac_zero",
    "max_weight",
    "null_mass",
    "frac_zero_mass",
)


def test_default_thresholds_are_the_documented_ones():
    """docs/analysis.md: eps = 0 for M and S on the centred scores, 1e-3 for "near zero", eps = 3 for
    sinks, the five top sinks, a gate below 0.1 counted as nearly closed."""
    from dataclasses import asdict

    from mmlight.analysis.stats import Settings

    assert asdict(Settings()) == {
        "eps_multimodality": 0.0,
        "eps_sparsity": 0.0,
        "near_zero": 1e-3,
        "sink_eps": 3.0,
        "top_sinks": 5,
        "zero_mass": 1e-9,
        "low_gate": 0.1,
    }


def test_rows_without_a_relevant_or_small_key_give_none():
    """Thresholds no centred score reaches: no row has M or S, so every head's value and the layer's
    are None (not NaN, not 0); the other metrics are unaffected."""
    from mmlight.analysis.stats import Settings

    stats = observe(Settings(eps_multimodality=100.0, eps_sparsity=-100.0), synthetic_batches())
    for entry in stats["sites"].values():
        for metric in ("multimodality", "sparsity"):
            assert entry["heads"][metric] == [None, None] and entry["metrics"][metric] is None
        assert None not in entry["heads"]["entropy"] and entry["metrics"]["entropy"] > 0


def test_a_site_whose_every_query_is_padding_reports_none():
    """No counted row: every mean is None, the histogram is empty, no position was seen (no sinks) and
    the rollout has no row."""
    from mmlight.analysis.stats import Settings, StatsObserver, summarize

    observer = StatsObserver(Settings())
    observer.query_keep = {"decoder": torch.zeros(1, 3, dtype=torch.bool)}
    q = k = torch.randn(1, 2, 3, 4)
    observer.edit_mask(SITES[DEC9], q, k, None)
    observer.record(SITES[DEC9], torch.full((1, 2, 3, 3), 1 / 3), None)
    observer.end_batch()
    observer.flush()
    entry = summarize(observer, {})["sites"][DEC9]
    assert all(entry["heads"][m] == [None, None] and entry["metrics"][m] is None for m in HEAD_METRICS_REF)
    assert entry["metrics"]["sink_ratio"] is None and entry["metrics"]["rollout_discrepancy"] is None
    assert entry["histogram"] == [0] * 33 and entry["incoming_mean"] == [None] * 3 and entry["top_sinks"] == []


def test_record_keeps_calls_until_their_bytes_exceed_keep_bytes():
    """kept_bytes counts the weights, the mask, the scores and the query mask of each kept call
    (float32 (2, 2, 3, 3): 144 bytes; bool (2, 1, 3, 3): 18; bool (2, 3): 6); a call that brings the
    total to exactly keep_bytes waits, the next one flushes everything and resets the count."""
    from mmlight.analysis.stats import Settings, StatsObserver

    observer = StatsObserver(Settings(), keep_bytes=312)
    observer.query_keep = {"decoder": torch.ones(2, 3, dtype=torch.bool)}
    q, k = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    keep, w = torch.ones(2, 1, 3, 3, dtype=torch.bool), torch.full((2, 2, 3, 3), 1 / 3)
    observer.edit_mask(SITES[DEC9], q, k, keep)
    observer.record(SITES[DEC9], w, keep)
    assert observer.kept_bytes == 144 + 18 + 144 + 6 and observer.sites == {} and len(observer._kept) == 1
    observer.edit_mask(SITES[DEC10], q, k, keep)
    observer.record(SITES[DEC10], w, keep)
    assert observer.kept_bytes == 0 and observer._kept == [] and list(observer.sites) == [DEC9, DEC10]
    # a ViT site on a fresh observer: no mask and no query mask (every query real), weights and scores only
    observer = StatsObserver(Settings(), keep_bytes=1000)
    observer.edit_mask(SITES["blocks.0"], q, k, None)
    observer.record(SITES["blocks.0"], w, None)
    assert observer.kept_bytes == 288 and observer._kept[0][4] is None


def test_metric_rows_of_a_hand_built_result():
    """Per head, then the layer value, for each head metric in order; rollout_discrepancy, sink_ratio
    and zero_mass_rows only when known (a count of 0 is known); then the blocks' token similarity."""
    from mmlight.analysis.stats import HEAD_METRICS

    assert HEAD_METRICS == HEAD_METRICS_REF
    heads = {m: [i + 0.1, None] for i, m in enumerate(HEAD_METRICS)}
    metrics = {m: i + 0.5 for i, m in enumerate(HEAD_METRICS)}
    stats = {
        "sites": {
            "blocks.0": {
                "heads": heads,
                "metrics": {**metrics, "rollout_discrepancy": 0.25, "sink_ratio": None, "zero_mass_rows": 3},
            },
            "blocks.1": {
                "heads": heads,
                "metrics": {**metrics, "rollout_discrepancy": None, "sink_ratio": 0.75, "zero_mass_rows": 0},
            },
        },
        "blocks": {"blocks.0": {"token_similarity": 0.3}, "blocks.1": {"token_similarity": None}},
    }
    want = []
    for site in ("blocks.0", "blocks.1"):
        for i, m in enumerate(HEAD_METRICS_REF):
            want += [(site, 0, m, i + 0.1), (site, 1, m, None), (site, None, m, i + 0.5)]
        want.append(
            ("blocks.0", None, "rollout_discrepancy", 0.25)
            if site == "blocks.0"
            else ("blocks.1", None, "sink_ratio", 0.75)
        )
        want.append((site, None, "zero_mass_rows", 3 if site == "blocks.0" else 0))
    want += [("blocks.0", None, "token_similarity", 0.3), ("blocks.1", None, "token_similarity", None)]
    assert metric_rows(stats) == want


def manual_block_similarity(layers, run, valid):
    """Per block: the mean over samples with >= 2 valid tokens of the mean cosine over pairs i != j of
    valid tokens of the block's output, by forward hooks of the test's own and a loop over pairs (the
    model runs unobserved here, on its fused attention path: equal to float32 rounding)."""
    outputs = {}
    handles = [
        layer.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out))
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        run()
    for h in handles:
        h.remove()
    result = {}
    for i, out in outputs.items():
        per_sample = []
        for b in range(out.shape[0]):
            idx = valid[b].nonzero().flatten().tolist()
            pairs = [
                torch.cosine_similarity(out[b, s].double(), out[b, t].double(), dim=0).item()
                for s in idx
                for t in idx
                if s != t
            ]
            if pairs:
                per_sample.append(sum(pairs) / len(pairs))
        result[i] = sum(per_sample) / len(per_sample) if per_sample else None
    return result


def test_lm_and_translator_token_similarity_over_real_tokens_in_eval_mode():
    """LM blocks: padding tokens and one-token samples left out (a batch of only those gives None); the
    translator's encoder blocks use the source mask, its decoder blocks the target padding. The model runs
    in eval mode throughout (dropout off) and is back in training mode after."""
    torch.manual_seed(0)
    task = LanguageModel(model=tiny_transformer(dropout=0.5))
    modes = []
    task.model.register_forward_pre_hook(lambda m, a: modes.append(m.training))
    tokens = torch.randint(2, 20, (3, 6))
    tokens[1, 4:] = PAD
    tokens[2, 1:] = PAD  # one real token: no pair
    stats = collect_statistics(task, [{"input": tokens[:2]}, {"input": tokens[2:]}])  # summed over batches
    assert modes == [False, False] and task.model.training
    task.model.eval()
    want = manual_block_similarity(task.model.decoder.layers, lambda: task.model(tokens), tokens != PAD)
    assert stats["blocks"].keys() == {"decoder.layers.0", "decoder.layers.1"}
    for i in (0, 1):
        assert stats["blocks"][f"decoder.layers.{i}"]["token_similarity"] == pytest.approx(
            want[i], rel=1e-6
        )  # float32 forward passes
    padded = collect_statistics(task, [{"input": tokens[2:]}])["blocks"]["decoder.layers.0"]
    assert padded == {"token_similarity": None, "stack": "decoder", "layer": 0}

    translator = Translator(model=tiny_transformer(n_encoder_layers=2)).eval()
    src, tgt = torch.randint(2, 20, (2, 5)), torch.randint(2, 20, (2, 4))
    src[0, 3:] = PAD
    tgt[1, 2:] = PAD
    stats = collect_statistics(translator, [{"src": src, "src_mask": src != PAD, "tgt_in": tgt}])
    assert not translator.model.training
    enc = manual_block_similarity(
        translator.model.encoder.layers, lambda: translator.model(src, tgt, src != PAD), src != PAD
    )
    dec = manual_block_similarity(
        translator.model.decoder.layers, lambda: translator.model(src, tgt, src != PAD), tgt != PAD
    )
    assert list(stats["blocks"]) == ["encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1"]
    for i in (0, 1):
        assert stats["blocks"][f"encoder.layers.{i}"]["token_similarity"] == pytest.approx(
            enc[i], rel=1e-6
        )  # float32 forward passes
        assert stats["blocks"][f"decoder.layers.{i}"]["token_similarity"] == pytest.approx(
            dec[i], rel=1e-6
        )  # float32 forward passes


def test_one_counted_row_by_hand():
    """One head, 3 keys, only the last query real: each key is seen once, so the incoming attention is
    that row's weights (relative: times 3 keys); near_zero = 0.25 counts weights strictly below 0.25."""
    from mmlight.analysis.stats import Settings, StatsObserver, summarize

    observer = StatsObserver(Settings(near_zero=0.25))
    observer.query_keep = {"decoder": torch.tensor([[False, False, True]])}
    q = k = torch.randn(1, 1, 3, 4)
    w = torch.tensor([[[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.5, 0.25, 0.25]]]])
    observer.edit_mask(SITES[DEC9], q, k, None)
    observer.record(SITES[DEC9], w, None)
    entry = summarize(observer, {})["sites"][DEC9]
    assert entry["incoming_mean"] == [0.5, 0.25, 0.25] and entry["incoming_relative"] == [1.5, 0.75, 0.75]
    assert entry["metrics"]["frac_below_1e-3"] == 0.0 and entry["metrics"]["max_weight"] == 0.5
    assert entry["heads"]["entropy"] == [pytest.approx(1.5 * math.log(2))]


def test_an_unseen_position_ranks_below_one_that_receives_zero_attention():
    """Key 0 is masked for every query (unseen: no mean), key 1 is seen but gets weight 0 (relative 0),
    key 2 gets everything: the two top sinks are 2 and 1, and the unseen key is never listed."""
    from mmlight.analysis.stats import Settings, StatsObserver, summarize

    observer = StatsObserver(Settings(top_sinks=2))
    q = k = torch.randn(1, 1, 2, 4)
    keep = torch.tensor([[[[False, True, True], [False, True, True]]]])
    w = torch.tensor([[[[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]]])
    observer.edit_mask(SITES["blocks.0"], q, k[:, :, :1].expand(1, 1, 3, 4), keep)
    observer.record(SITES["blocks.0"], w, keep)
    entry = summarize(observer, {})["sites"]["blocks.0"]
    assert entry["incoming_relative"] == [None, 0.0, 2.0]
    assert entry["top_sinks"] == [{"position": 2, "relative": 2.0}, {"position": 1, "relative": 0.0}]


def test_vit_sites_are_listed_in_numeric_layer_order():
    """blocks.10 comes after blocks.2 (numeric, not text, order) in the result, whatever the record order."""
    from mmlight.analysis.stats import Settings, StatsObserver, summarize

    observer = StatsObserver(Settings())
    q = k = torch.randn(1, 1, 2, 4)
    for site in ("blocks.10", "blocks.2"):
        observer.edit_mask(SITES[site], q, k, None)
        observer.record(SITES[site], torch.full((1, 1, 2, 2), 0.5), None)
    assert list(summarize(observer, {})["sites"]) == ["blocks.2", "blocks.10"]


def test_weights_that_do_not_sum_to_one_against_a_hand_computation():
    """Rows with mass below 1 (softmax1, softpick, stick-breaking): the null mass 1 - sum(w) per head and
    layer, zero-mass rows counted apart and left out of entropy, M and S, which describe the renormalised
    weights; sinks from the mass actually given (renormalising would make key 0 a sink at sink_eps 1.2)."""
    from mmlight.analysis.stats import Settings, StatsObserver, summarize
    from tests.helpers.references import naive_m_and_s

    w = torch.tensor(
        [
            [[0.5, 0.25, 0.0], [0.0, 0.0, 0.0], [0.2, 0.2, 0.2]],  # head 0: masses 0.75, 0, 0.6
            [[0.6, 0.2, 0.2], [0.9, 0.0, 0.0], [0.1, 0.1, 0.1]],
        ],  # head 1: masses 1, 0.9, 0.3
        dtype=torch.float64,
    )[None]  # (1, 2, 3, 3)
    q, k = torch.randn(1, 2, 3, 4, dtype=torch.float64), torch.randn(1, 2, 3, 4, dtype=torch.float64)
    observer = StatsObserver(Settings(sink_eps=1.2))
    observer.edit_mask(SITES["blocks.0"], q, k, None)
    observer.record(SITES["blocks.0"], w, None)
    observer.end_batch()
    observer.flush()
    entry = summarize(observer, {})["sites"]["blocks.0"]

    assert entry["heads"]["null_mass"] == pytest.approx([(0.25 + 1 + 0.4) / 3, (0 + 0.1 + 0.7) / 3], abs=1e-15)
    assert entry["metrics"]["null_mass"] == pytest.approx((0.25 + 1 + 0.4 + 0 + 0.1 + 0.7) / 6, abs=1e-15)
    assert entry["heads"]["frac_zero_mass"] == [pytest.approx(1 / 3), 0.0]
    assert entry["metrics"]["zero_mass_rows"] == 1
    # renormalised: head 0 rows (2/3, 1/3, 0) and uniform; head 1 rows (.6, .2, .2), (1, 0, 0) and uniform
    ln3 = math.log(3)
    head0 = [ln3 - 2 / 3 * math.log(2), ln3]
    head1 = [-(0.6 * math.log(0.6) + 0.4 * math.log(0.2)), 0.0, ln3]
    assert entry["heads"]["entropy"] == pytest.approx([sum(head0) / 2, sum(head1) / 3], abs=1e-12)
    assert entry["metrics"]["entropy"] == pytest.approx((sum(head0) + sum(head1)) / 5, abs=1e-12)
    assert entry["heads"]["normalized_entropy"] == pytest.approx([sum(head0) / 2 / ln3, sum(head1) / 3 / ln3])
    x = (q @ k.transpose(-2, -1) / 2).numpy()[0]  # the scores edit_mask computes (hs ** -0.5 = 1/2)
    kept = np.ones(3, dtype=bool)
    for metric, index in (("multimodality", 0), ("sparsity", 1)):
        want = []
        for h, rows in ((0, (0, 2)), (1, (0, 1, 2))):
            p = w[0, h].numpy()
            values = [naive_m_and_s(x[h, i], p[i] / p[i].sum(), kept, 0.0, 0.0)[index] for i in rows]
            values = [v for v in values if not math.isnan(v)]
            want.append(sum(values) / len(values) if values else None)
        assert close(entry["heads"][metric], want), metric
    # incoming attention from the given weights: key j receives sum_w * 3 keys / 6 (head, row) pairs
    assert entry["incoming_relative"] == pytest.approx([2.3 * 3 / 6, 0.75 * 3 / 6, 0.5 * 3 / 6])
    assert entry["metrics"]["sink_ratio"] == 0.0
    assert entry["heads"]["max_weight"] == pytest.approx([(0.5 + 0 + 0.2) / 3, (0.6 + 0.9 + 0.1) / 3])

    # a row whose mass is exactly zero_mass attends to nothing ("at most this"): at 0.75 that is head 0's
    # first row (0.5 + 0.25, exact in binary) besides the rows of mass 0, 0.6 and 0.3
    observer = StatsObserver(Settings(zero_mass=0.75))
    observer.edit_mask(SITES["blocks.0"], q, k, None)
    observer.record(SITES["blocks.0"], w, None)
    observer.flush()
    entry = summarize(observer, {})["sites"]["blocks.0"]
    assert entry["metrics"]["zero_mass_rows"] == 4 and entry["heads"]["frac_zero_mass"] == [1.0, pytest.approx(1 / 3)]


def test_renormalised_rows_sum_to_one_and_rows_without_mass_are_zeros():
    from mmlight.reweighting.metrics import renormalised

    weights = torch.tensor([[[0.5, 0.25, 0.0], [0.0, 0.0, 0.0], [0.3, 0.3, 0.3]]], dtype=torch.float64)  # (1, 3, 3)
    mass = weights.sum(-1)
    got = renormalised(weights, mass, mass > 0)
    want = torch.tensor([[[2 / 3, 1 / 3, 0.0], [0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0.0)


def test_stick_breaking_lm_reports_its_first_queries_as_zero_mass_rows():
    """A stick-breaking LM: every first query attends to nothing (null mass 1), the others give
    mass below 1; the callback's rows carry null_mass per layer."""
    torch.manual_seed(0)
    task = LanguageModel(model=tiny_transformer(attention=ReweightingSpec("stickbreaking")))
    tokens = torch.randint(2, 20, (3, 6))
    stats = collect_statistics(task, [{"input": tokens}])
    with record_attention(task) as recorder:
        task.model.eval()
        task.model(tokens)
    for site, entry in stats["sites"].items():
        mass = recorder[site][0].weights.double().sum(-1)  # (B, nh, T)
        assert entry["metrics"]["zero_mass_rows"] == int((mass <= 1e-9).sum()) >= 3 * 2
        assert entry["heads"]["null_mass"] == pytest.approx((1 - mass).mean((0, 2)).tolist(), rel=1e-9)
    rows = {(layer, metric) for layer, head, metric, _ in metric_rows(stats) if head is None}
    assert ("decoder.layers.1.self_attn", "null_mass") in rows
