"""The interventions' runs and sink masking against brute force on small cases, and their effect through a model
(the KV eviction masks themselves: tests/analysis/test_kv_eviction.py)."""

import math

import pytest
import torch

from mmlight.analysis.robustness import KVEviction, SinkMasking
from mmlight.nn.attention import causal_mask, observe_attention
from mmlight.nn.sites import AttentionSite
from mmlight.reweighting import Softmax
from tests.helpers.models import micro_vit, tiny_transformer

SITE = AttentionSite("decoder.layers.3.self_attn", "decoder_self", "decoder", 3, Softmax())


def vit_site(module=None) -> AttentionSite:
    """A ViT block's site with ``module`` (a softmax by default) as its reweighting."""
    return AttentionSite("blocks.0", "self", "blocks", 0, Softmax() if module is None else module)


def decoder_site(layer: int, kind: str = "decoder_self") -> AttentionSite:
    """The site of a decoder layer's self- or cross-attention."""
    name = f"decoder.layers.{layer}.{'cross_attn' if kind == 'cross' else 'self_attn'}"
    return AttentionSite(name, kind, "decoder", layer, Softmax(), key_stack="encoder" if kind == "cross" else None)


def test_sink_masking_masks_a_hand_built_sink():
    torch.manual_seed(0)
    T = 8
    q = torch.randn(2, 2, T, 4)
    k = torch.randn(2, 2, T, 4) * 0.1
    k[0, :, 5] = q[0].mean(1) * 50  # every query of sample 0 scores key 5 highest
    k[1, :, 2] = q[1].mean(1) * 50
    masking = SinkMasking(k=1)
    got = masking.edit_mask(vit_site(), q, k, None)  # (B, nh, T, T)
    assert (~got[0, :, :, 5]).all() and (~got[1, :, :, 2]).all()
    assert got.sum() == 2 * 2 * T * (T - 1)
    assert masking.edit_mask(decoder_site(0, "cross"), q, k, None) is None


def test_sink_masking_changes_a_vit_forward_and_is_gone_afterwards():
    from mmlight.models import ReweightedViT

    model = ReweightedViT(micro_vit()).eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        plain = model(x)
        with observe_attention(model, SinkMasking(k=5)):
            masked = model(x)
        again = model(x)
    assert not torch.allclose(plain, masked, atol=1e-4)
    assert torch.allclose(plain, again, atol=1e-6)


def observed_now():
    """The (sites, observer) pair that attention calls are routed through at this moment, or None."""
    import importlib

    return importlib.import_module("mmlight.nn.attention")._OBSERVED.get()


class StandInTrainer:
    """``validate``/``test`` that report which observer was active during the call and which split ran,
    as Lightning's return value: one dict of logged metrics (or none, ``empty``)."""

    def __init__(self, metric: str, empty: bool = False):
        self.metric, self.empty, self.calls, self.tasks, self.settings = metric, empty, [], [], []

    def _run(self, split, task, datamodule, verbose):
        active = observed_now()
        observer = active[1] if active else None
        self.calls.append((split, observer, datamodule, verbose))
        self.tasks.append(task)
        self.settings.append((getattr(task, "bleu_in_validation", None), getattr(task, "output_dir", None)))
        # one dict per evaluation loader; the first is the split's own
        return (
            []
            if self.empty
            else [{f"{split}/{self.metric}": float(len(self.calls)), "other": 0.5}, {f"{split}/{self.metric}": -1.0}]
        )

    def validate(self, task, datamodule=None, verbose=True):
        return self._run("val", task, datamodule, verbose)

    def test(self, task, datamodule=None, verbose=True):
        return self._run("test", task, datamodule, verbose)


def test_robustness_rows_run_every_intervention_in_order_under_its_observer():
    """LM: the plain run, sink masking at 1, 5, 10, then l2 and streaming eviction at every ratio, each
    evaluated once under its own observer (none afterwards); rows carry the task metric of that run."""
    from mmlight.analysis.robustness import KEEP_RATIOS, KV_METHODS, SINK_LEVELS, robustness_rows, robustness_runs
    from mmlight.tasks import LanguageModel

    task = LanguageModel(model=tiny_transformer(n_layers=3))
    entered, context = [], task.metric_evaluation  # the protocol hands the task the split it evaluates
    task.metric_evaluation = lambda split, scratch: entered.append(split) or context(split, scratch)
    trainer, ticks = StandInTrainer("ppl"), []
    rows = robustness_rows(trainer, task, "the datamodule", "test", skip_layers=1, progress=ticks.append)
    assert entered == ["test"]
    want = (
        [("none", 0)]
        + [("sink_masking", k) for k in SINK_LEVELS]
        + [(f"kv_{method}", r) for method in KV_METHODS for r in KEEP_RATIOS]
    )
    assert [(name, level) for name, level, _, _ in rows] == want
    assert [(metric, value) for _, _, metric, value in rows] == [("ppl", float(i + 1)) for i in range(len(want))]
    assert len(rows) == len(robustness_runs(task, skip_layers=1)) == 4 + 5 * 6 and ticks == [1] * 34
    observers = [observer for _, observer, _, _ in trainer.calls]
    assert observers[0] is None and all(
        split == "test" and dm == "the datamodule" and verbose is False for split, _, dm, verbose in trainer.calls
    )
    assert [o.k for o in observers[1:4]] == list(SINK_LEVELS)
    assert all(t is task for t in trainer.tasks)  # every run evaluates the task itself
    evictions = observers[4:]
    assert [(o.method.name, o.ratio, o.skip_layers) for o in evictions] == [
        (method, r, 1) for method in KV_METHODS for r in KEEP_RATIOS
    ]
    assert observed_now() is None  # nothing left observing after the runs


def test_robustness_rows_for_other_tasks_and_a_run_without_the_metric():
    """Image tasks get the plain run and sink masking only, NMT also KV eviction (its beam search
    decodes through the cache), on the split asked for; NMT runs
    beam search in validation and writes its files to a scratch folder, for the runs only and without
    touching its hyperparameters; a run that logs no task metric is an error naming what it logged."""
    from mmlight.analysis.robustness import robustness_rows, robustness_runs
    from mmlight.tasks import ImageClassifier, LanguageModel, Translator

    image = ImageClassifier(model=micro_vit(num_classes=3))
    trainer = StandInTrainer("top1")
    rows = robustness_rows(trainer, image, None, "val")
    assert [r[:3] for r in rows] == [
        ("none", 0, "top1"),
        ("sink_masking", 1, "top1"),
        ("sink_masking", 5, "top1"),
        ("sink_masking", 10, "top1"),
    ]
    translator = Translator(tiny_transformer(n_layers=3, n_encoder_layers=1))
    assert len(rows) == len(robustness_runs(image)) == 4
    assert [(name, level) for name, level, _ in robustness_runs(translator)] == [
        (name, level) for name, level, _ in robustness_runs(LanguageModel(tiny_transformer(n_layers=3)))
    ]
    assert {split for split, *_ in trainer.calls} == {"val"}
    assert translator.hparams.bleu_in_validation is False
    bleu = StandInTrainer("bleu")
    assert [r[2] for r in robustness_rows(bleu, translator, None, "val")] == ["bleu"] * 34
    from pathlib import Path

    scratch = {Path(output_dir) for _, output_dir in bleu.settings}
    assert {generates for generates, _ in bleu.settings} == {True} and len(scratch) == 1
    assert next(iter(scratch)).name.startswith("mmlight-robustness-") and not next(iter(scratch)).exists()
    assert (translator.bleu_in_validation, translator.output_dir) == (False, None)  # the constructor's again
    assert (translator.hparams.bleu_in_validation, translator.hparams.output_dir) == (False, None)
    with pytest.raises(RuntimeError, match=r"the val run logged no val/top1 \(it logged \[\]\)"):
        robustness_rows(StandInTrainer("top1", empty=True), image, None, "val")


def brute_force_sinks(q, k, keep, n_sinks):
    """The masked keys by a loop: softmax over each row's kept keys (scale 1/sqrt(head size)), each
    key's weight times the row's number of kept keys summed over heads and rows, top n_sinks per sample."""
    B, H, T, hs = q.shape
    out = keep.clone()
    for b in range(B):
        relative = [0.0] * T
        for h in range(H):
            for i in range(T):
                kept = [j for j in range(T) if keep[b, h, i, j]]
                scores = [float(q[b, h, i] @ k[b, h, j]) / math.sqrt(hs) for j in kept]
                top = max(scores, default=0.0)
                z = sum(math.exp(s - top) for s in scores)
                for j, s in zip(kept, scores):
                    relative[j] += math.exp(s - top) / z * len(kept)
        for j in sorted(range(T), key=lambda j: -relative[j])[:n_sinks]:
            out[b, :, :, j] = False
    return out


@pytest.mark.parametrize("n_sinks", [1, 2, 3])
def test_sink_masking_against_brute_force_under_a_causal_padded_mask(n_sinks):
    """Random scores at a head size of 64 (where the 1/sqrt(hs) scale matters for which keys win, and
    differs from 1/sqrt of any other dimension), causal rows and a padded sample: the masked keys are a
    loop's top keys, masked for every query."""
    torch.manual_seed(2)
    B, H, T, hs = 3, 2, 6, 64
    q, k = torch.randn(B, H, T, hs, dtype=torch.float64) * 2, torch.randn(B, H, T, hs, dtype=torch.float64) * 2
    real = torch.ones(B, T, dtype=torch.bool)
    real[2, 4:] = False
    mask = (causal_mask(T, T)[None] & real[:, None, :])[:, None]  # (B, 1, T, T)
    got = SinkMasking(k=n_sinks).edit_mask(SITE, q, k, mask)
    assert got.shape == (B, H, T, T)
    assert torch.equal(got, brute_force_sinks(q, k, mask.expand(B, H, T, T), n_sinks))


def test_sink_masking_of_more_keys_than_there_are_masks_every_key():
    q = k = torch.randn(1, 2, 4, 8)
    got = SinkMasking(k=10).edit_mask(vit_site(), q, k, None)
    assert got.shape == (1, 2, 4, 4) and not got.any()


def test_robustness_rows_evict_from_layer_2_by_default():
    from mmlight.analysis.robustness import robustness_rows
    from mmlight.tasks import LanguageModel

    task = LanguageModel(model=tiny_transformer(n_layers=3))
    trainer = StandInTrainer("ppl")
    robustness_rows(trainer, task, None, "val")
    assert {observer.skip_layers for _, observer, _, _ in trainer.calls[4:]} == {2}
    assert {split for split, *_ in trainer.calls} == {"val"}


def test_interventions_build_their_masks_on_the_device_of_q_and_k():
    """On "meta" tensors (standing in for CUDA ones without a GPU), any tensor made on the CPU by mistake
    fails the comparison with the keys; the masks come back on q's device, with the call's shape."""
    q, k = torch.randn(1, 2, 3, 4, device="meta"), torch.randn(1, 2, 5, 4, device="meta")
    for method in ("l2", "streaming"):
        got = KVEviction(0.5, method, skip_layers=0).edit_mask(SITE, q, k, None)
        assert got.device.type == "meta" and got.shape == (1, 2, 3, 5)
    got = SinkMasking(k=1).edit_mask(vit_site(), q, k[:, :, :3], None)
    assert got.device.type == "meta" and got.shape == (1, 2, 3, 3)


class BackendSpy(Softmax):
    """Softmax that records the backend each call asks for (and computes the reference)."""

    def __init__(self, backend):
        super().__init__(backend=backend)
        self.asked = []

    def compute(self, scores, mask, backend):
        self.asked.append(backend)
        return super().compute(scores, mask, "reference")


def test_sink_masking_computes_weights_with_the_site_backend():
    spy = BackendSpy("compile")
    q = k = torch.randn(1, 2, 4, 8)
    SinkMasking(k=1).edit_mask(vit_site(spy), q, k, None)
    assert spy.asked == ["compile"]


def test_robustness_runs_skip_two_layers_by_default_and_name_unknown_interventions():
    from mmlight.analysis.robustness import KVEviction, robustness_runs
    from mmlight.tasks import LanguageModel

    task = LanguageModel(tiny_transformer(n_layers=3))
    evictions = [observer for _, _, observer in robustness_runs(task) if isinstance(observer, KVEviction)]
    assert [o.skip_layers for o in evictions] == [2] * 30  # KVEviction's default, as the docs say
    task.interventions = ("kv_eviction", "dropout", "head_pruning")
    with pytest.raises(ValueError) as err:
        robustness_runs(task)
    assert str(err.value) == (
        "LanguageModel.interventions names unknown interventions ['dropout', 'head_pruning']; "
        "known: sink_masking, kv_eviction"
    )


def test_robustness_runs_evict_at_the_keep_ratios_asked_for():
    from mmlight.analysis.robustness import KV_METHODS, SINK_LEVELS, robustness_runs
    from mmlight.tasks import LanguageModel

    runs = robustness_runs(LanguageModel(tiny_transformer(n_layers=1)), skip_layers=0, keep_ratios=(0.9, 0.3))
    assert [(name, level) for name, level, _ in runs] == [("none", 0)] + [("sink_masking", k) for k in SINK_LEVELS] + [
        (f"kv_{method}", r) for method in KV_METHODS for r in (0.9, 0.3)
    ]
    assert [(o.ratio, o.method.name, o.skip_layers) for _, _, o in runs[4:8]] == [
        (0.9, "l2", 0),
        (0.3, "l2", 0),
        (0.9, "streaming", 0),
        (0.3, "streaming", 0),
    ]


def test_robustness_rows_evaluate_at_the_keep_ratios_asked_for():
    from mmlight.analysis.robustness import SINK_LEVELS, robustness_rows
    from mmlight.tasks import LanguageModel

    trainer = StandInTrainer("ppl")
    rows = robustness_rows(trainer, LanguageModel(tiny_transformer(n_layers=1)), None, "val", 0, None, (0.5,))
    assert [(name, level) for name, level, _, _ in rows] == [("none", 0)] + [
        ("sink_masking", k) for k in SINK_LEVELS
    ] + [(f"kv_{method}", 0.5) for method in ("l2", "streaming", "expected_attention", "oracle", "random")]


@pytest.mark.parametrize("method", ["l2", "streaming"])
def test_kv_eviction_through_the_cache_of_a_rotary_grouped_query_lm_equals_teacher_forcing(method):
    """A Llama-style LM (rotary positions, 4 query heads over 2 key/value heads): evicting keys while decoding
    token by token through the KV cache (keys rotated at their absolute positions when cached) gives the
    log-probabilities of the teacher-forced forward under the same eviction; query heads that share a key
    head keep the same keys."""
    from mmlight.models.transformer import LLAMA_STYLE, TransformerLM
    from mmlight.nn.attention import AttentionRecorder
    from tests.helpers.models import tiny

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = TransformerLM(tiny(**LLAMA_STYLE, n_heads=4, n_kv_heads=2, max_positions=8)).eval()
    x = torch.randint(2, 23, (2, 12))  # longer than max_positions: rotary positions have no table

    class Recording(KVEviction, AttentionRecorder):
        def __init__(self):
            KVEviction.__init__(self, 0.5, method, skip_layers=0)
            AttentionRecorder.__init__(self)

    with observe_attention(model, Recording()) as full_run:
        full = model.logits(model(x)).log_softmax(-1)  # (B, T, V)
    with observe_attention(model, Recording()):
        cache = model.new_cache()
        steps = [model.logits(model(x[:, t : t + 1], cache=cache)).log_softmax(-1) for t in range(12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    keep = full_run["decoder.layers.1.self_attn"][0].keep  # (B, nh, T, T)
    assert torch.equal(keep[:, 0], keep[:, 1]) and torch.equal(keep[:, 2], keep[:, 3])
    assert keep[:, :, -1].sum(-1).tolist() == [[7] * 4] * 2  # own key + ceil(0.5 * 11) past keys
