"""The throughput callback: FLOPs per sample against a hand count, the device peaks, and the logged tags.

The micro models come from ``tests/models/test_vit.py`` (``micro_vit``) and
``tests/models/test_transformer.py`` (``tiny``).
"""

from __future__ import annotations

import pytest
import torch

from mmlight.callbacks.throughput import PEAK_BF16_DENSE, peak_flops, training_step_flops
from mmlight.reweighting import ReweightingSpec
from mmlight.tasks import ImageClassifier, LanguageModel
from tests.helpers.models import micro_vit, tiny


def matmul(m: int, k: int, n: int) -> int:
    """FLOPs of an (m, k) x (k, n) product: one multiply and one add per term."""
    return 2 * m * k * n


@pytest.mark.parametrize("name", ["softmax", "multimax"])  # SDPA and the explicit scores
def test_vit_flops_per_sample_are_the_hand_count(name):
    task = ImageClassifier(micro_vit(attention=ReweightingSpec(name), drop_path_rate=0.0))
    batch = (torch.randn(3, 1, 8, 8), torch.randint(0, 10, (3,)))
    # vit_micro on 8x8 one-channel images in 2x2 patches: N = 16 tokens (avg pooling, no CLS token),
    # width D = 64, 4 blocks, MLP 4D, 10 classes.
    N, D, depth, classes = 16, 64, 4, 10
    patch = matmul(N, 1 * 2 * 2, D)  # the patch convolution as a product
    block = (
        matmul(N, D, 3 * D)  # q, k, v
        + matmul(N, D, N)  # scores q k^T, all heads together (heads x head_dim = D)
        + matmul(N, N, D)  # weights x v
        + matmul(N, D, D)  # output projection
        + matmul(N, D, 4 * D)
        + matmul(N, 4 * D, D)  # MLP
    )
    head = matmul(1, D, classes)  # on the pooled token
    forward = patch + depth * block + head
    # backward: each product twice (the gradient of both operands), except the patch convolution,
    # whose input (the images) needs none
    backward = 2 * (depth * block + head) + patch
    assert training_step_flops(task, batch) / 3 == forward + backward == 19_681_024


@pytest.mark.parametrize("name", ["softmax", "multimax"])
def test_transformer_lm_flops_per_sample_are_the_hand_count(name):
    task = LanguageModel(tiny(name=name))
    B, T = 3, 7
    batch = {
        "input": torch.randint(2, 23, (B, T)),
        "target": torch.randint(2, 23, (B, T)),
        "loss_mask": torch.ones(B, T, dtype=torch.bool),
    }
    # tiny: 2 decoder layers, d 32, FFN 48, 23 tokens; causal attention computes all T x T scores
    layers, d, ffn, V = 2, 32, 48, 23
    layer = (
        4 * matmul(T, d, d)  # q, k, v and output projections
        + matmul(T, d, T)  # scores
        + matmul(T, T, d)  # weights x v
        + matmul(T, d, ffn)
        + matmul(T, ffn, d)  # feed-forward
    )
    forward = layers * layer + matmul(T, d, V)  # the output projection
    # backward: every product twice (the embeddings require grad, so even the first layer's input does)
    assert training_step_flops(task, batch) / B == 3 * forward == 670_656


def test_peaks_are_dense_bf16_and_the_cpu_has_none(monkeypatch):
    assert peak_flops(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda", 0)) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_flops(torch.device("cuda", 0)) == 312e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    assert peak_flops(torch.device("cuda", 0)) is None
    assert PEAK_BF16_DENSE["H200"] == PEAK_BF16_DENSE["H100"]


def test_a_fit_logs_samples_per_second_flops_and_the_mean(tmp_path, caplog):
    import logging

    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mmlight.callbacks import Throughput
    from mmlight.data import DigitsDataModule, write_digits_shards
    from tests.helpers.trainer import quiet_trainer

    write_digits_shards(tmp_path / "digits")
    task = ImageClassifier(micro_vit(drop_path_rate=0.0), lr_reference_batch=None)
    logger = TensorBoardLogger(tmp_path / "runs", name="t")
    trainer = quiet_trainer(max_steps=6, limit_val_batches=0, logger=logger, log_every_n_steps=1)
    trainer.callbacks.append(Throughput(window_size=3))
    with caplog.at_level(logging.INFO):
        trainer.fit(task, DigitsDataModule(cache_dir=str(tmp_path / "digits"), batch_size=16))
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/device/samples_per_sec", "train/device/flops_per_sec", "train/flops_per_sample"} <= tags
    assert "train/device/mfu" not in tags  # the CPU has no peak
    assert [e.value for e in events.Scalars("train/flops_per_sample")] == [19_681_024.0]
    assert all(e.value > 0 for e in events.Scalars("train/device/samples_per_sec"))
    assert "samples/s" in trainer.progress_bar_metrics
    assert "mean throughput:" in caplog.text and "no MFU" in caplog.text


def test_a_network_on_the_triton_backend_is_counted_by_its_reference():
    task = ImageClassifier(micro_vit(attention=ReweightingSpec("multimax"), drop_path_rate=0.0, backend="triton"))
    batch = (torch.randn(3, 1, 8, 8), torch.randint(0, 10, (3,)))
    assert training_step_flops(task, batch) / 3 == 19_681_024
    assert {m.backend for m in task.model.modules() if hasattr(m, "backend")} == {"triton"}  # the task's own


def test_a_task_without_the_protocol_fits_without_throughput_and_a_warning_names_what_it_lacks():
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from mmlight.callbacks.throughput import Throughput
    from tests.helpers.trainer import quiet_trainer

    class Plain(L.LightningModule):  # a task written outside mmlight
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val/loss", torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,))), batch_size=4)
    callback = Throughput(window_size=1)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=1, callbacks=[callback])
    with pytest.warns(UserWarning, match="Plain has no counts_tokens, batch_counts, training_loss"):
        trainer.fit(Plain(), data, data)
    assert trainer.global_step == 3
    assert callback.disabled and callback.flops_per_sample is None
