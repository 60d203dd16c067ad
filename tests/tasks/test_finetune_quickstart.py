"""The CPU fine-tuning quick start: an ImageClassifier checkpoint of digits 0-5, fine-tuned through
the CLI on the held-out digits 6-9 with configs/finetune/digits_6to9.yaml."""

import sys
from pathlib import Path

import pytest
import torch

from mmlight.cli import build_cli
from mmlight.data import DigitsDataModule
from mmlight.models import ReweightedViT, ReweightingSpec, ViTConfig
from mmlight.tasks import ImageClassifier
from tests.helpers.models import micro_vit
from tests.helpers.trainer import quiet_trainer

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = micro_vit(num_classes=6, drop_path_rate=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A few steps of the digits quick start on the digits 0-5, saved as Lightning saves it."""
    tmp = tmp_path_factory.mktemp("pretrain")
    torch.manual_seed(0)
    module = ImageClassifier(PRETRAIN, lr_reference_batch=None)
    trainer = quiet_trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=0)
    trainer.fit(module, DigitsDataModule(cache_dir=str(tmp / "digits"), digits=[0, 1, 2, 3, 4, 5], batch_size=32))
    path = tmp / "last.ckpt"
    trainer.save_checkpoint(path)
    return path, module


def test_identity_start_is_the_checkpoint(checkpoint):
    """Loaded with MultiMax at init_std 0 and its 6-class head kept: the checkpoint's logits (to fp32
    rounding: the softmax model runs through SDPA, the MultiMax one takes the explicit path)."""
    path, pretrained = checkpoint
    config = ViTConfig(
        **{**PRETRAIN.__dict__, "pretrained": str(path), "attention": ReweightingSpec("multimax", {"init_std": 0})}
    )
    model = ReweightedViT(config).eval()
    assert model.pretrained_report.dropped == {}
    images = torch.randn(6, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(images), pretrained.model.eval()(images), atol=1e-5, rtol=1e-5)


def test_quick_start_config_fine_tunes_a_new_head(checkpoint, tmp_path, monkeypatch):
    path, pretrained = checkpoint
    monkeypatch.setattr(sys, "argv", ["mmlight"])
    cli = build_cli(
        [
            "--config",
            str(ROOT / "configs/finetune/digits_6to9.yaml"),
            "--model.init_args.model.pretrained",
            str(path),
            "--data.init_args.cache_dir",
            str(tmp_path / "d"),
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "runs"),
            "--trainer.max_epochs",
            "1",
            "--trainer.limit_train_batches",
            "2",
            "--trainer.limit_val_batches",
            "1",
        ],
        run=False,
    )
    model = cli.model.model
    assert set(model.pretrained_report.dropped) == {"head.weight", "head.bias"}  # 6 classes there, 4 here
    want = pretrained.model.state_dict()
    for name, value in model.state_dict().items():
        if ".reweight." not in name and not name.startswith("vit.head."):
            assert torch.equal(value, want[name]), name
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 2
    assert cli.datamodule.digits == [6, 7, 8, 9] and model.vit.head.weight.shape == (4, 64)
