"""collect_statistics on tiny models of the three kinds against computations from weights recorded
with record_attention and masks built here, independently of the observer."""

import pytest
import torch

from mmlight.analysis.stats import collect_statistics, kind_of, metric_rows
from mmlight.models import ViTConfig
from mmlight.models.transformer import TransformerConfig
from mmlight.nn.attention import record_attention
from mmlight.reweighting import ReweightingSpec
from mmlight.tasks import ImageClassifier, LanguageModel, Translator

PAD = 1


def tiny_config(**overrides) -> TransformerConfig:
    return TransformerConfig(**{"vocab_size": 20, "d_model": 16, "n_heads": 2, "ffn_dim": 32, "n_layers": 2,
                                "n_encoder_layers": 0, "max_positions": 32, "pad_id": PAD, **overrides})


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
    task = LanguageModel(model=tiny_config(attention=ReweightingSpec("sparsemax")))
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
            (weights[counted] < 1e-3).double().mean().item())
        assert sum(stats["sites"][site]["histogram"]) == counted.sum().item()


def test_translation_reports_encoder_decoder_and_cross_attention_separately():
    torch.manual_seed(0)
    task = Translator(model=tiny_config(n_encoder_layers=2))
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
    task = ImageClassifier(model=ViTConfig(variant="vit_micro", img_size=8, patch_size=2, in_chans=1,
                                           num_classes=10, global_pool="token"))
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

    task = LanguageModel(model=tiny_config())
    samples = []
    collect_statistics(task, [{"input": torch.randint(2, 20, (2, 5))}, {"input": torch.randint(2, 20, (3, 5))}],
                       progress=samples.append)
    assert attn_module._OBSERVED.get() is None
    assert task.model.training  # the mode is restored
    assert samples == [2, 3]  # the progress bar advances by each batch's samples


def test_layer_index_of_sites_and_blocks():
    from mmlight.analysis.stats import layer_index

    assert [layer_index(n) for n in ("blocks.0", "blocks.11.attn", "decoder.layers.3.self_attn",
                                     "encoder.layers.12.self_attn")] == [0, 11, 3, 12]
    with pytest.raises(ValueError, match="no layer index in 'head'"):
        layer_index("head")


def test_kind_of_sites():
    assert [kind_of(s) for s in ("blocks.0", "encoder.layers.1.self_attn", "decoder.layers.0.self_attn",
                                 "decoder.layers.2.cross_attn")] == ["self", "encoder_self", "decoder_self", "cross"]


def test_deferred_reduction_gives_the_same_statistics_and_keeps_memory_bounded():
    """record_statistics may leave the reduction for later (the training callback finishes it on a
    background thread): the result equals the batch-by-batch one, and past keep_bytes it reduces at once."""
    from mmlight.analysis.stats import record_statistics

    torch.manual_seed(0)
    task = LanguageModel(model=tiny_config(n_layers=3))
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
