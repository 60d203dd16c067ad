"""ImageClassifier: EMA arithmetic, mixup training step, learning-rate scaling."""

import lightning as L
import numpy as np
import pytest
import torch

from mmlight.data import DigitsDataModule, write_digits_shards
from mmlight.models import ReweightingSpec
from mmlight.tasks import ImageClassifier
from tests.helpers.models import micro_vit
from tests.helpers.trainer import quiet_trainer

MICRO = micro_vit(attention=ReweightingSpec("multimax"), output_multimax=True, drop_path_rate=0.0)


def test_ema_follows_the_exponential_average():
    module = ImageClassifier(MICRO, ema_decay=0.9)
    first = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    module.update_ema()  # first update copies the weights
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(1.0)
    module.update_ema()
    ema = dict(module.ema.module.named_parameters())
    for name, p in module.model.named_parameters():
        torch.testing.assert_close(ema[name], 0.9 * first[name] + 0.1 * p.detach())
    assert not any(p.requires_grad for p in module.ema.parameters())


def test_mixup_step_uses_soft_targets():
    module = ImageClassifier(MICRO, mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1)
    module.log = lambda *a, **k: None
    images, labels = torch.randn(8, 1, 8, 8), torch.arange(8) % 10
    np.random.seed(3)  # timm draws lambda and the mode with numpy
    loss = module.training_step((images.clone(), labels), 0)  # timm mixes in place
    np.random.seed(3)  # timm draws lambda and the mode with numpy
    mixed, targets = module.mixup(images.clone(), labels)
    want = -(targets * torch.log_softmax(module(mixed), -1)).sum(-1).mean()
    torch.testing.assert_close(loss, want)
    assert torch.allclose(targets.sum(-1), torch.ones(8))


def test_lr_scales_with_global_batch_and_odd_batch_fails_with_mixup(tmp_path):
    write_digits_shards(tmp_path)
    module = ImageClassifier(MICRO, lr=5e-4, lr_reference_batch=512, warmup_epochs=1, mixup_alpha=0.8)
    trainer = quiet_trainer(max_epochs=2, limit_train_batches=3, limit_val_batches=0, accumulate_grad_batches=2)
    dm = DigitsDataModule(cache_dir=str(tmp_path), batch_size=64)
    trainer.fit(module, dm)
    peak = 5e-4 * 64 * 2 / 512  # one device, two accumulated batches
    assert trainer.optimizers[0].param_groups[0]["initial_lr"] == pytest.approx(peak)
    with pytest.raises(ValueError, match="even per-device batch size"):
        L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False).fit(
            ImageClassifier(MICRO, mixup_alpha=0.8), DigitsDataModule(cache_dir=str(tmp_path), batch_size=7)
        )


def test_class_count_mismatch_stops_fit(tmp_path):
    write_digits_shards(tmp_path)
    wrong = ImageClassifier(micro_vit(num_classes=7))
    with pytest.raises(ValueError, match="the data has 10 classes but model.num_classes is 7"):
        L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False).fit(
            wrong, DigitsDataModule(cache_dir=str(tmp_path))
        )


def fit_start(module, **datamodule):
    from types import SimpleNamespace

    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(**datamodule))
    module.on_fit_start()


def test_fit_start_checks_batch_parity_and_class_count_without_training():
    mixing = ImageClassifier(MICRO, mixup_alpha=0.8)
    with pytest.raises(ValueError, match="^mixup/cutmix needs an even per-device batch size, got 7$"):
        fit_start(mixing, batch_size=7, num_classes=10)
    fit_start(mixing, batch_size=8, num_classes=10)
    fit_start(mixing)  # a datamodule that says neither
    fit_start(ImageClassifier(MICRO), batch_size=7, num_classes=10)  # odd is fine without mixing
    cutmix_only = ImageClassifier(MICRO, cutmix_alpha=1.0)
    with pytest.raises(ValueError, match="even per-device batch size"):
        fit_start(cutmix_only, batch_size=3)
    with pytest.raises(ValueError, match="^the data has 9 classes but model.num_classes is 10$"):
        fit_start(ImageClassifier(MICRO), batch_size=8, num_classes=9)


def test_mixup_gets_the_recipes_arguments():
    module = ImageClassifier(MICRO, mixup_alpha=0.8, cutmix_alpha=1.0, mixup_switch_prob=0.3, label_smoothing=0.2)
    m = module.mixup
    assert (m.mixup_alpha, m.cutmix_alpha, m.switch_prob, m.label_smoothing, m.num_classes) == (0.8, 1.0, 0.3, 0.2, 10)
    assert ImageClassifier(MICRO).mixup is None
    cutmix_only = ImageClassifier(MICRO, cutmix_alpha=0.5).mixup
    assert (cutmix_only.mixup_alpha, cutmix_only.cutmix_alpha, cutmix_only.num_classes) == (0.0, 0.5, 10)


def test_each_optimizer_step_updates_the_ema_once(monkeypatch):
    import lightning as L

    module = ImageClassifier(MICRO, ema_decay=0.5)
    monkeypatch.setattr(L.LightningModule, "optimizer_step", lambda self, *a, **k: None)
    for _ in range(3):
        module.optimizer_step(0, None)
    assert int(module.ema.n_averaged) == 3
    ImageClassifier(MICRO).update_ema()  # no EMA: nothing to do
