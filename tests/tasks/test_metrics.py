"""Every logged evaluation number of the tasks from fixed logits, against NumPy: top-1, top-5, the
sample-weighted loss and ``ema_top1`` of the classifier; accuracy, loss and perplexity of the language
model; the training losses with label smoothing; and the optimiser schedules the tasks configure."""

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmlight.models import TransformerConfig
from mmlight.tasks import ImageClassifier, LanguageModel, Translator
from tests.helpers.models import micro_vit, tiny_transformer
from tests.helpers.references import lrs

NUM_CLASSES = 7


class FixedLogits(nn.Module):
    """Returns row ``i`` of ``table`` for an image whose first pixel is ``i``."""

    def __init__(self, table: np.ndarray):
        super().__init__()
        self.register_buffer("table", torch.as_tensor(table, dtype=torch.float32))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.table[images[:, 0, 0, 0].long()]


class Averaged(nn.Module):
    """Stands in for the EMA's ``AveragedModel``: the averaged network as ``.module``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


class LogRecorder:
    """Stands in for ``LightningModule.log``: keeps each call's value and options."""

    def __init__(self):
        self.values, self.options = {}, {}

    def __call__(self, name, value, **options):
        self.values[name] = float(value.detach() if isinstance(value, torch.Tensor) else value)
        self.options[name] = options


def np_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    log_norm = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    return log_norm - z[np.arange(len(labels)), labels]


def np_topk_hits(logits: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    ranked = np.argsort(-logits, axis=1)[:, :k]
    return (ranked == labels[:, None]).any(1)


def classifier_with_fixed_logits(n: int, seed: int = 0, num_classes: int = NUM_CLASSES):
    rng = np.random.default_rng(seed)
    logits, ema_logits = rng.normal(size=(2, n, num_classes)).astype(np.float32)
    labels = rng.integers(0, num_classes, size=n)
    module = ImageClassifier(micro_vit(num_classes=num_classes), ema_decay=0.9)
    module.model, module.ema = FixedLogits(logits), Averaged(FixedLogits(ema_logits))
    module.log = LogRecorder()
    images = torch.zeros(n, 1, 8, 8)
    images[:, 0, 0, 0] = torch.arange(n)
    return module, images, torch.as_tensor(labels), logits, ema_logits, labels


@pytest.mark.parametrize("stage", ["val", "test"])
def test_classifier_metrics_from_fixed_logits(stage):
    n = 13
    module, images, labels, logits, ema_logits, y = classifier_with_fixed_logits(n)
    step, epoch_end = (
        (module.validation_step, module.on_validation_epoch_end)
        if stage == "val"
        else (module.test_step, module.on_test_epoch_end)
    )
    for _repeat in range(2):  # a second epoch starts from zero again
        for i, (start, stop) in enumerate([(0, 8), (8, n)]):  # unequal batches: the loss is sample-weighted
            step((images[start:stop], labels[start:stop]), i)
        epoch_end()
        logged = module.log.values
        assert logged[f"{stage}/top1"] == pytest.approx(np_topk_hits(logits, y, 1).mean())
        assert logged[f"{stage}/top5"] == pytest.approx(np_topk_hits(logits, y, 5).mean())
        assert logged[f"{stage}/loss"] == pytest.approx(np_cross_entropy(logits, y).mean(), rel=1e-6)
        assert logged[f"{stage}/ema_top1"] == pytest.approx(np_topk_hits(ema_logits, y, 1).mean())
        assert sorted(logged) == sorted(f"{stage}/{k}" for k in ("loss", "top1", "top5", "ema_top1"))
    # the fixture is not degenerate: the four numbers differ and none is 0 or 1
    values = [logged[f"{stage}/{k}"] for k in ("top1", "top5", "ema_top1")]
    assert len(set(values)) == 3 and all(0 < v < 1 for v in values)
    assert {k: o["prog_bar"] for k, o in module.log.options.items()} == {
        f"{stage}/loss": False,
        f"{stage}/top1": True,
        f"{stage}/top5": False,
        f"{stage}/ema_top1": False,
    }


def test_top5_is_top_k_of_all_classes_when_there_are_fewer():
    module, images, labels, logits, _, y = classifier_with_fixed_logits(6, num_classes=3)
    module.validation_step((images, labels), 0)
    module.on_validation_epoch_end()
    assert module.log.values["val/top5"] == 1.0 and module.log.values["val/top1"] == pytest.approx(
        np_topk_hits(logits, y, 1).mean()
    )


def test_top5_counts_ranks_one_to_five_exactly():
    """Seven samples whose label is the 1st, 2nd, ..., 7th highest score: top-1 is 1/7 and top-5 is
    5/7 (a label ranked 6th must not count), as NumPy's ranking gives."""
    module, images, *_ = classifier_with_fixed_logits(NUM_CLASSES)
    logits = np.tile(-np.arange(NUM_CLASSES, dtype=np.float32), (NUM_CLASSES, 1))  # class c is ranked c + 1
    module.model = FixedLogits(logits)
    y = np.arange(NUM_CLASSES)  # so sample i's label is ranked i + 1
    module.validation_step((images, torch.as_tensor(y)), 0)
    module.on_validation_epoch_end()
    assert np_topk_hits(logits, y, 5).mean() == pytest.approx(5 / 7)
    assert module.log.values["val/top5"] == pytest.approx(5 / 7)
    assert module.log.values["val/top1"] == pytest.approx(1 / 7)


def test_no_ema_metric_without_ema():
    module = ImageClassifier(micro_vit(num_classes=4))
    assert module.ema is None and sorted(module.eval_metrics["val"]) == ["loss", "top1", "top5"]
    # off: no averaged copy in the checkpoint either (with it, its weights are there under ema.module.)
    assert not [k for k in module.state_dict() if k.startswith("ema.")]
    with_ema = ImageClassifier(micro_vit(num_classes=4), ema_decay=0.9).state_dict()
    assert torch.equal(with_ema["ema.module.vit.head.weight"], with_ema["model.vit.head.weight"])


def test_classifier_predict_step_returns_softmax_and_argmax():
    module, images, _, logits, _, _ = classifier_with_fixed_logits(5)
    for batch in (images, (images, torch.zeros(5))):
        out = module.predict_step(batch, 0)
        z = logits.astype(np.float64)
        probs = np.exp(z - z.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        np.testing.assert_allclose(out["probs"].numpy(), probs, rtol=1e-5)
        np.testing.assert_array_equal(out["pred"].numpy(), logits.argmax(1))


def test_classifier_training_loss_is_label_smoothed_cross_entropy():
    module = ImageClassifier(
        micro_vit(num_classes=5, drop_path_rate=0.0),
        label_smoothing=0.2,
    ).eval()
    module.log = LogRecorder()
    images, labels = torch.randn(6, 1, 8, 8), torch.tensor([0, 1, 2, 3, 4, 0])
    loss = module.training_step((images, labels), 0)
    want = F.cross_entropy(module(images).double(), labels, label_smoothing=0.2)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert loss.item() != pytest.approx(F.cross_entropy(module(images), labels).item(), rel=1e-3)
    assert module.log.values["train/loss"] == loss.item() and module.log.options["train/loss"] == {"prog_bar": True}


PAD = 1
V = 11


def tiny_lm(**task) -> LanguageModel:
    torch.manual_seed(0)
    config = tiny_transformer(vocab_size=V, n_layers=1, dropout=0.0, max_positions=16)
    return LanguageModel(config, **task).eval()


def lm_batches(model: LanguageModel, seed: int = 0) -> list[dict]:
    """Two batches whose targets are the model's own argmax on about 70% of the positions, with masked
    and padded targets, so that accuracy is strictly between 0 and 1 and not 1/2 (where counting
    the misses instead of the hits would give the same number)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for b, t in ((2, 6), (3, 4)):
        inputs = torch.randint(2, V, (b, t), generator=gen)
        with torch.no_grad():
            predicted = model(inputs).argmax(-1)
        target = torch.where(
            torch.rand(b, t, generator=gen) < 0.7, predicted, torch.randint(2, V, (b, t), generator=gen)
        )
        target[0, -1] = PAD
        mask = torch.rand(b, t, generator=gen) > 0.2
        batches.append({"input": inputs, "target": target, "loss_mask": mask})
    return batches


def np_lm_reference(model: LanguageModel, batches: list[dict]) -> tuple[int, int, float]:
    """(correct, scored, summed NLL) over the scored targets: masked in and not padding."""
    correct = count = 0
    nll = 0.0
    for batch in batches:
        with torch.no_grad():
            logits = model(batch["input"]).double().numpy()  # (B, T, V)
        target, keep = batch["target"].numpy(), batch["loss_mask"].numpy() & (batch["target"].numpy() != PAD)
        z, y = logits[keep], target[keep]
        correct += int((z.argmax(1) == y).sum())
        count += int(keep.sum())
        nll += float(np_cross_entropy(z, y).sum())
    return correct, count, nll


@pytest.mark.parametrize("stage", ["val", "test"])
def test_language_model_accuracy_loss_and_perplexity(stage):
    module = tiny_lm(accuracy=True)
    module.log = LogRecorder()
    batches = lm_batches(module)
    correct, count, nll = np_lm_reference(module, batches)
    assert 0 < correct < count and 2 * correct != count
    step, epoch_end = (
        (module.validation_step, module.on_validation_epoch_end)
        if stage == "val"
        else (module.test_step, module.on_test_epoch_end)
    )
    for _repeat in range(2):  # totals are reset after each epoch
        for i, batch in enumerate(batches):
            step(batch, i)
        epoch_end()
        logged = module.log.values
        assert logged[f"{stage}/acc"] == pytest.approx(correct / count)
        assert logged[f"{stage}/tokens"] == count
        assert logged[f"{stage}/loss"] == pytest.approx(nll / count, rel=1e-5)
        assert logged[f"{stage}/ppl"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    # every value is already summed over ranks: none is synced again
    assert module.log.options == {
        f"{stage}/acc": {"prog_bar": True, "sync_dist": False},
        f"{stage}/loss": {"sync_dist": False},
        f"{stage}/ppl": {"prog_bar": True, "sync_dist": False},
        f"{stage}/tokens": {"sync_dist": False},
    }


def test_language_model_accuracy_of_an_epoch_with_one_scored_token_and_of_an_empty_one(caplog):
    module = tiny_lm(accuracy=True)
    module.log = LogRecorder()
    batch = lm_batches(module)[0]
    one = dict(batch, loss_mask=torch.zeros_like(batch["loss_mask"]))
    one["loss_mask"][0, 0] = True
    correct, count, _ = np_lm_reference(module, [one])
    assert count == 1
    module.validation_step(one, 0)
    module.on_validation_epoch_end()
    assert module.log.values["val/acc"] == correct and module.log.values["val/tokens"] == 1
    module.log = LogRecorder()
    module.on_validation_epoch_end()  # no scored token: no accuracy (not 0/0), no loss
    assert module.log.values == {} and "no scored tokens" in caplog.text


def test_language_model_without_accuracy_logs_no_accuracy(caplog):
    module = tiny_lm()
    module.log = LogRecorder()
    for i, batch in enumerate(lm_batches(module)):
        module.validation_step(batch, i)
    module.on_validation_epoch_end()
    assert sorted(module.log.values) == ["val/loss", "val/ppl", "val/tokens"]
    module.log = LogRecorder()
    module.on_validation_epoch_end()  # an epoch with no scored token logs nothing and says so
    assert module.log.values == {} and "no scored tokens" in caplog.text


def test_language_model_training_loss_is_the_smoothed_mean_over_scored_targets():
    module = tiny_lm(label_smoothing=0.1)
    module.log = LogRecorder()
    batch = lm_batches(module)[0]
    loss = module.training_step(batch, 0)
    keep = batch["loss_mask"] & (batch["target"] != PAD)
    want = F.cross_entropy(module(batch["input"])[keep].double(), batch["target"][keep], label_smoothing=0.1)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert module.log.values["train/loss"] == pytest.approx(want.item(), rel=1e-5)
    assert module.log.options["train/loss"] == {"prog_bar": True}
    one = dict(batch, loss_mask=torch.zeros_like(batch["loss_mask"]))
    one["loss_mask"][1, 2] = True  # a single scored target: its own loss, not half of it
    single = F.cross_entropy(module(batch["input"])[1, 2:3].double(), batch["target"][1, 2:3], label_smoothing=0.1)
    assert module.training_step(one, 0).item() == pytest.approx(single.item(), rel=1e-5)


def test_translator_training_loss_and_token_count():
    module = tiny_translator_task(label_smoothing=0.1)
    module.log = LogRecorder()
    src = torch.tensor([[4, 5, 6, 2], [7, 8, PAD, PAD]])
    tgt_in = torch.tensor([[2, 4, 9], [2, 3, PAD]])
    tgt_out = torch.tensor([[4, 9, 2], [3, 2, PAD]])
    batch = {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out, "src_mask": src != PAD, "tgt_mask": tgt_out != PAD}
    loss = module.training_step(batch, 0)
    keep = tgt_out != PAD
    want = F.cross_entropy(module(src, tgt_in, src != PAD)[keep].double(), tgt_out[keep], label_smoothing=0.1)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert module.log.values["train/tokens"] == 5 and module.log.options["train/loss"] == {"prog_bar": True}
    one = dict(batch, tgt_mask=torch.zeros_like(keep))
    one["tgt_mask"][0, 1] = True  # a single scored target: its own loss
    single = F.cross_entropy(module(src, tgt_in, src != PAD)[0, 1:2].double(), tgt_out[0, 1:2], label_smoothing=0.1)
    assert module.training_step(one, 0).item() == pytest.approx(single.item(), rel=1e-5)
    assert module.log.values["train/tokens"] == 1
    assert module.log.options["train/tokens"]["reduce_fx"] == "sum"
    narrowed = src != PAD
    narrowed[0, 2] = False  # the batch's own source mask is what the model sees, not one rebuilt from padding
    masked = F.cross_entropy(module(src, tgt_in, narrowed)[keep].double(), tgt_out[keep], label_smoothing=0.1)
    assert abs(masked.item() - want.item()) > 1e-4
    assert module.training_step(dict(batch, src_mask=narrowed), 0).item() == pytest.approx(masked.item(), rel=1e-5)


def test_data_with_another_padding_id_is_refused():
    module = tiny_lm()
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(vocab_size=V, pad_id=0))
    with pytest.raises(ValueError, match="^the data pads with id 0 but model.pad_id is 1$"):
        module.setup("fit")
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(vocab_size=V + 1, pad_id=PAD))
    with pytest.raises(
        ValueError,
        match=f"^the data's vocabulary has {V + 1} tokens but model.vocab_size is {V}: "
        f"set model.model.vocab_size: {V + 1}$",
    ):
        module.setup("fit")
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(vocab_size=V, pad_id=PAD))
    module.setup("fit")
    module._trainer = SimpleNamespace(datamodule=None)
    module.setup("fit")
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(vocab_size=V))  # no pad_id: nothing to compare
    module.setup("fit")
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(pad_id=PAD))  # no vocab_size either
    module.setup("fit")


def cosine_reference(peak: float, floor: float, warmup: int, total: int, steps: int) -> list[float]:
    """Linear warmup from peak/warmup, then a cosine from peak to floor at ``total``."""
    out = []
    for s in range(steps):
        if s < warmup:
            out.append(peak * (s + 1) / warmup)
        else:
            progress = min(1.0, (s - warmup) / max(1, total - warmup))  # all warmup: stays at the peak
            out.append(floor + (peak - floor) * (1 + math.cos(math.pi * progress)) / 2)
    return out


def test_sequence_task_optimiser_and_cosine_schedule():
    module = tiny_lm(
        schedule="cosine", warmup_steps=4, lr=1e-3, min_lr=1e-4, eps=1e-7, weight_decay=0.02, betas=(0.8, 0.9)
    )
    module._trainer = SimpleNamespace(estimated_stepping_batches=10)
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert configured["lr_scheduler"]["interval"] == "step"
    assert isinstance(optimizer, torch.optim.AdamW)
    assert (optimizer.defaults["betas"], optimizer.defaults["eps"]) == ((0.8, 0.9), 1e-7)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.02, 0.0]
    assert lrs(optimizer, scheduler, 12) == pytest.approx(cosine_reference(1e-3, 1e-4, 4, 10, 12))
    module._trainer = SimpleNamespace(estimated_stepping_batches=3)  # warmup longer than the run
    configured = module.configure_optimizers()
    assert lrs(configured["optimizer"], configured["lr_scheduler"]["scheduler"], 3) == pytest.approx(
        cosine_reference(1e-3, 1e-4, 3, 3, 3)
    )
    for endless in (float("inf"), -1, 0):
        module._trainer = SimpleNamespace(estimated_stepping_batches=endless)
        with pytest.raises(
            ValueError, match="^the cosine schedule needs a finite run: set trainer.max_steps or max_epochs$"
        ):
            module.configure_optimizers()
    module._trainer = SimpleNamespace(estimated_stepping_batches=1)  # a one-step run is a run
    configured = module.configure_optimizers()
    assert lrs(configured["optimizer"], configured["lr_scheduler"]["scheduler"], 1) == pytest.approx([1e-3])


def test_a_floor_above_the_peak_is_the_peak():
    module = tiny_lm(schedule="cosine", warmup_steps=2, lr=1e-4, min_lr=1e-3)
    module._trainer = SimpleNamespace(estimated_stepping_batches=6)
    configured = module.configure_optimizers()
    assert lrs(configured["optimizer"], configured["lr_scheduler"]["scheduler"], 7) == pytest.approx(
        [5e-5] + [1e-4] * 6
    )


def test_inverse_sqrt_schedule_of_the_sequence_tasks():
    module = tiny_lm(warmup_steps=3, lr=1e-2)
    configured = module.configure_optimizers()
    seen = lrs(configured["optimizer"], configured["lr_scheduler"]["scheduler"], 6)
    assert seen == pytest.approx([1e-2 * n / 3 if n < 3 else 1e-2 * math.sqrt(3 / n) for n in range(1, 7)])


@pytest.mark.parametrize("task", [LanguageModel, Translator])
def test_sequence_task_arguments_are_checked(task):
    """Both tasks hand their own schedule and smoothing to the check (a misspelt schedule would
    otherwise fall through to the cosine branch of configure_optimizers)."""
    config = TransformerConfig(
        vocab_size=V, d_model=8, n_heads=2, ffn_dim=8, n_layers=1, n_encoder_layers=int(task is Translator)
    )
    with pytest.raises(ValueError, match="^schedule must be 'inverse_sqrt' or 'cosine', got 'linear'$"):
        task(config, schedule="linear")
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=rf"^label_smoothing must be in \[0, 1\), got {bad}$"):
            task(config, label_smoothing=bad)
    task(config, label_smoothing=0.0)
    assert task(config, schedule="cosine").hparams.schedule == "cosine"


def test_classifier_schedule_in_epochs_and_batch_scaled_lr():
    module = ImageClassifier(
        micro_vit(num_classes=4),
        lr=5e-4,
        lr_reference_batch=512,
        warmup_epochs=1.5,
        min_lr=1e-5,
        betas=(0.8, 0.95),
    )
    module._trainer = SimpleNamespace(
        estimated_stepping_batches=20,
        max_epochs=4,
        world_size=2,
        accumulate_grad_batches=3,
        datamodule=SimpleNamespace(batch_size=32),
    )
    configured = module.configure_optimizers()
    optimizer = configured["optimizer"]
    peak = 5e-4 * 32 * 2 * 3 / 512
    assert optimizer.defaults["betas"] == (0.8, 0.95) and configured["lr_scheduler"]["interval"] == "step"
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    # 20 steps over 4 epochs: 5 per epoch, so 1.5 warmup epochs are round(7.5) = 8 steps
    assert lrs(optimizer, configured["lr_scheduler"]["scheduler"], 21) == pytest.approx(
        cosine_reference(peak, 1e-5, 8, 20, 21)
    )
    module._trainer.max_epochs = -1  # a run bounded by steps only: warmup_epochs count whole-run steps
    configured = module.configure_optimizers()
    assert lrs(configured["optimizer"], configured["lr_scheduler"]["scheduler"], 21) == pytest.approx(
        cosine_reference(peak, 1e-5, 20, 20, 21)
    )
    module.hparams.min_lr = 1.0  # a floor above the peak is the peak: flat after the warm-up, never above it
    module._trainer.max_epochs = 4
    configured = module.configure_optimizers()
    assert lrs(configured["optimizer"], configured["lr_scheduler"]["scheduler"], 21)[8:] == pytest.approx([peak] * 13)
    module._trainer.datamodule = SimpleNamespace()
    with pytest.raises(
        ValueError,
        match="^lr_reference_batch needs a datamodule with a batch_size attribute; "
        "set model.lr_reference_batch: null to use lr as given$",
    ):
        module.configure_optimizers()
    module.hparams.lr_reference_batch = None
    configured = module.configure_optimizers()
    assert configured["optimizer"].param_groups[0]["initial_lr"] == 5e-4


def test_language_model_predict_step_scores_each_sequence():
    module = tiny_lm()
    batch = lm_batches(module)[1]
    out = module.predict_step(batch, 0)
    for b in range(batch["input"].shape[0]):
        row = {k: v[b : b + 1] for k, v in batch.items()}
        correct, count, nll = np_lm_reference(module, [row])
        assert out["tokens"][b].item() == count and out["nll"][b].item() == pytest.approx(nll, rel=1e-5)


def tiny_translator_task(**task) -> Translator:
    """A one-layer encoder-decoder over ``V`` tokens (``PAD`` padding), seeded, in eval mode.

    Args:
        task: ``Translator`` arguments (e.g. ``label_smoothing``).
    """
    torch.manual_seed(0)
    config = tiny_transformer(vocab_size=V, n_layers=1, n_encoder_layers=1, dropout=0.0, max_positions=16)
    return Translator(config, **task).eval()


def test_translator_evaluation_loss_is_padding_free_and_uses_the_batchs_masks():
    """``val/loss`` of a padded batch equals the NLL of each sentence scored alone, without padding
    (float64 cross-entropy of the task's own logits); the batch's source and target masks are the
    ones used: a narrowed source mask changes the loss, a narrowed target mask scores only its targets."""
    module = tiny_translator_task()
    module.log = LogRecorder()
    src = torch.tensor([[4, 5, 6, 2], [7, 8, 2, PAD]])
    tgt_in = torch.tensor([[2, 4, 9], [2, 3, PAD]])
    tgt_out = torch.tensor([[4, 9, 2], [3, 2, PAD]])
    batch = {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out, "src_mask": src != PAD, "tgt_mask": tgt_out != PAD}

    def alone_nll(s, t_in, t_out, src_mask=None) -> float:
        with torch.no_grad():
            logits = module(s[None], t_in[None], src_mask)[0].double()
        return F.cross_entropy(logits, t_out, reduction="sum").item()

    alone = alone_nll(src[0], tgt_in[0], tgt_out[0]) + alone_nll(src[1, :3], tgt_in[1, :2], tgt_out[1, :2])
    module.validation_step(batch, 0)
    module.on_validation_epoch_end()
    assert module.log.values["val/tokens"] == 5
    assert module.log.values["val/loss"] == pytest.approx(alone / 5, rel=1e-5)

    narrowed = src != PAD
    narrowed[0, 1] = False
    want = (
        alone_nll(src[0], tgt_in[0], tgt_out[0], narrowed[:1]) + alone_nll(src[1, :3], tgt_in[1, :2], tgt_out[1, :2])
    ) / 5
    module.validation_step(dict(batch, src_mask=narrowed), 0)
    module.on_validation_epoch_end()
    assert abs(want - alone / 5) > 1e-4 and module.log.values["val/loss"] == pytest.approx(want, rel=1e-5)

    only = torch.zeros_like(batch["tgt_mask"])
    only[1, 0] = True  # one scored target
    module.validation_step(dict(batch, tgt_mask=only), 0)
    module.on_validation_epoch_end()
    with torch.no_grad():
        first = F.cross_entropy(module(src[1:2, :3], tgt_in[1:2, :1])[0].double(), tgt_out[1, :1]).item()
    assert module.log.values["val/tokens"] == 1 and module.log.values["val/loss"] == pytest.approx(first, rel=1e-5)


def test_optimizer_step_steps_the_optimiser_then_averages_the_weights():
    """The EMA follows each optimiser step: after the first step it is a copy of the new weights,
    after the second ``decay * ema + (1 - decay) * weights`` (SGD's step and the average written out)."""
    module = ImageClassifier(micro_vit(num_classes=3), ema_decay=0.75)
    weight = module.model.vit.head.weight
    optimizer = torch.optim.SGD([weight], lr=0.5)
    gradient = torch.full_like(weight, 0.2)

    def closure():
        weight.grad = gradient.clone()
        return torch.zeros(())

    start = weight.detach().clone()
    module.optimizer_step(0, 0, optimizer, closure)
    after_one = start - 0.5 * gradient
    ema_weight = module.ema.module.vit.head.weight  # the averaged copy of module.model
    assert torch.allclose(weight, after_one) and torch.allclose(ema_weight, after_one)
    module.optimizer_step(epoch=0, batch_idx=1, optimizer=optimizer, optimizer_closure=closure)  # by keyword too
    after_two = after_one - 0.5 * gradient
    assert torch.allclose(weight, after_two) and torch.allclose(ema_weight, 0.75 * after_one + 0.25 * after_two)


def test_task_defaults_are_the_papers_recipes():
    """The defaults a config leaves out are the recipes the paper follows: DeiT's (Touvron et al.,
    2021: AdamW 5e-4 per 512 images, weight decay 0.05, 5 warm-up epochs, cosine to 1e-5, label
    smoothing 0.1), fairseq's transformer_lm on WikiText-103 (Adam 0.9/0.98, eps 1e-8, 5e-4,
    inverse_sqrt with 4,000 warm-up updates, weight decay 0.01, no smoothing) and fairseq's IWSLT14
    de-en example (the same Adam and schedule, weight decay 1e-4, label smoothing 0.1). Read from
    the hyperparameters a task built without them saves (what a checkpoint and the optimiser get)."""

    def saved(module) -> dict:
        return {k: v for k, v in module.hparams.items() if k != "model"}

    vit = micro_vit(num_classes=3)
    assert saved(ImageClassifier(vit)) == {
        "lr": 5e-4,
        "lr_reference_batch": 512,
        "weight_decay": 0.05,
        "betas": (0.9, 0.999),
        "warmup_epochs": 5.0,
        "min_lr": 1e-5,
        "label_smoothing": 0.1,
        "mixup_alpha": 0.0,
        "cutmix_alpha": 0.0,
        "mixup_switch_prob": 0.5,
        "ema_decay": None,
        # fine-tuning options, off by default: one learning rate, nothing frozen
        "head_lr_mult": 1.0,
        "reweighting_lr_mult": 1.0,
        "layer_decay": None,
        "freeze_backbone_epochs": 0,
        "compile": False,  # the network runs eagerly unless asked
    }
    lm_config = TransformerConfig(vocab_size=V, d_model=8, n_heads=2, ffn_dim=8, n_layers=1)
    assert saved(LanguageModel(lm_config)) == {
        "lr": 5e-4,
        "betas": (0.9, 0.98),
        "eps": 1e-8,
        "weight_decay": 0.01,
        "schedule": "inverse_sqrt",
        "warmup_steps": 4000,
        "min_lr": 1e-5,
        "label_smoothing": 0.0,
        "accuracy": False,
        "compile": False,
    }
    translator = saved(Translator(dataclasses.replace(lm_config, n_encoder_layers=1)))
    # fairseq's IWSLT14 example: --eval-bleu-args '{"beam": 5, "max_len_a": 1.2, "max_len_b": 10}', and
    # fairseq-generate's own --lenpen 1 and --min-len 1 (written out, not BeamSearchConfig()'s defaults)
    assert dataclasses.asdict(translator.pop("beam")) == {
        "beam_size": 5,
        "max_len_a": 1.2,
        "max_len_b": 10,
        "length_penalty": 1.0,
        "min_len": 1,
    }
    assert translator == {
        "lr": 5e-4,
        "betas": (0.9, 0.98),
        "eps": 1e-8,
        "weight_decay": 1e-4,
        "schedule": "inverse_sqrt",
        "warmup_steps": 4000,
        "min_lr": 1e-9,
        "label_smoothing": 0.1,
        "bleu_in_validation": False,
        "output_dir": None,
        "compile": False,
    }
    # and they reach the optimiser: a task built without arguments uses them
    module = LanguageModel(lm_config)
    optimizer = module.configure_optimizers()["optimizer"]
    assert (optimizer.defaults["betas"], optimizer.defaults["eps"]) == ((0.9, 0.98), 1e-8)
    assert [g["initial_lr"] for g in optimizer.param_groups] == [5e-4, 5e-4]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
