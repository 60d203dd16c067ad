"""The throughput callback: FLOPs per sample against a hand count, the device peaks, and the logged tags.

The micro models come from ``tests/models/test_vit.py`` (``micro_vit``) and
``tests/models/test_transformer.py`` (``tiny``).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

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
    names = {torch.device("cuda", 0): "NVIDIA GeForce RTX 4090", torch.device("cuda", 1): "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[device])
    assert peak_flops(torch.device("cuda", 1)) == 989e12  # the device asked about, not the current one
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda", 0)) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_flops(torch.device("cuda", 0)) == 312e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    assert peak_flops(torch.device("cuda", 0)) is None
    assert PEAK_BF16_DENSE["H200"] == PEAK_BF16_DENSE["H100"]


def test_a_fit_logs_the_hand_counted_rates_and_flops_at_the_loss_steps(tmp_path, caplog, monkeypatch):
    """A fit of 16 images per batch whose clock advances 0.25 s per reading: samples/s is 16 x 2 batches /
    0.5 s = 64 over a window of 3, FLOPs/s that times the hand-counted FLOPs per sample, at the steps and the
    log_every_n_steps of the training loss; the end of fit prints the mean of the batches after the first."""
    import itertools
    import logging

    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mmlight.callbacks import Throughput
    from mmlight.callbacks import throughput as module
    from mmlight.data import DigitsDataModule, write_digits_shards
    from tests.helpers.trainer import quiet_trainer

    write_digits_shards(tmp_path / "digits")
    ticks = itertools.count()
    monkeypatch.setattr(module, "perf_counter", lambda: 0.25 * next(ticks))  # read once at the start, once a batch
    task = ImageClassifier(micro_vit(drop_path_rate=0.0), lr_reference_batch=None)
    logger = TensorBoardLogger(tmp_path / "runs", name="t")
    trainer = quiet_trainer(max_steps=6, limit_val_batches=0, logger=logger, log_every_n_steps=2)
    trainer.callbacks.append(Throughput(window_size=3))
    with caplog.at_level(logging.INFO):
        trainer.fit(task, DigitsDataModule(cache_dir=str(tmp_path / "digits"), batch_size=16))
    events = EventAccumulator(logger.log_dir)
    events.Reload()

    def logged(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    flops = 19_681_024  # test_vit_flops_per_sample_are_the_hand_count
    assert logged("train/flops_per_sample") == [(0, flops)]
    # steps 2, 4, 6 under the loss's step numbers (1, 3, 5); the window of 3 is full from the third batch
    assert [step for step, _ in logged("train/loss")] == [1, 3, 5]
    assert logged("train/samples") == [(1, 32), (3, 64), (5, 96)]
    assert logged("train/time") == [(1, 0.5), (3, 1.0), (5, 1.5)]
    assert logged("train/device/samples_per_sec") == [(3, 64.0), (5, 64.0)]
    assert logged("train/device/batches_per_sec") == [(3, 4.0), (5, 4.0)]
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in logged("train/device/flops_per_sec")] == [
        (3, 64 * flops),
        (5, 64 * flops),
    ]
    tags = set(events.Tags()["scalars"])
    assert "train/device/mfu" not in tags and "train/samples_per_sec" not in tags  # the CPU: no peak; one device
    assert "train/device/items_per_sec" not in tags  # images: no tokens
    assert not {"samples/s", "tokens/s"} & tags  # the progress bar's figures are not logged twice
    assert trainer.progress_bar_metrics["samples/s"] == 64.0 and "tokens/s" not in trainer.progress_bar_metrics
    # after the first batch: 5 batches of 16 in 1.25 s
    assert f"mean throughput: 64.0 samples/s on 1 device(s), {flops:.4g} FLOPs per sample (no MFU" in caplog.text


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
    callback = Throughput(window_size=2)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=1, callbacks=[callback])
    warning = (
        "Throughput: Plain has no counts_tokens, batch_counts, training_loss (mmlight/callbacks/throughput.py), "
        "so this run logs no samples/s, tokens/s or MFU"
    )
    with pytest.warns(UserWarning, match=f"^{re.escape(warning)}$"):
        trainer.fit(Plain(), data, data)
    assert trainer.global_step == 3
    assert callback.disabled and callback.flops_per_sample is None


# ---------------------------------------------------------------------------- the hooks with stand-ins

PER_SAMPLE = 1e12  # FLOPs per sample of the stand-in task: an MFU of a few percent on an H100


class Recorder:
    """A logger: what was logged, by step."""

    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step):
        self.logged.append((step, dict(metrics)))


def stand_ins(monkeypatch, times, world_size=2, device="cuda", name="NVIDIA H100 80GB HBM3", tokens=True):
    """A trainer on ``world_size`` devices named ``name``, a task of 4 samples (28 tokens, counted where
    ``tokens``) per batch and :data:`PER_SAMPLE` FLOPs per sample, and a clock that reads ``times`` in turn;
    ``synced`` lists the devices the clock waited for."""
    from mmlight.callbacks import throughput as module

    clock, synced = iter(times), []
    monkeypatch.setattr(module, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(module, "training_step_flops", lambda task, batch: PER_SAMPLE * batch["n"])
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device(device, 0) if device == "cuda" else torch.device(device)),
        world_size=world_size,
        sanity_checking=False,
        loggers=[Recorder()],
        global_step=0,
        log_every_n_steps=1,
        should_stop=False,
        state=SimpleNamespace(fn="fit"),
    )
    shown = {}
    task = SimpleNamespace(  # its batches hold 7 tokens a sample, counted only where counts_tokens says so
        counts_tokens=tokens,
        batch_counts=lambda batch: (batch["n"], batch["n"] * 7),
        training_loss=None,
        log=lambda name, value, **options: shown.__setitem__(name, value),
    )
    return trainer, task, shown, synced


def train_batches(callback, trainer, task, count, step=True):
    for _ in range(count):
        callback.on_train_batch_start(trainer, task, {"n": 4}, 0)
        trainer.global_step += step
        callback.on_train_batch_end(trainer, task, None, {"n": 4}, 0)


def test_rates_and_mfu_on_two_devices_against_counts_by_hand(monkeypatch, caplog):
    """Batches of 4 samples (28 tokens) every 0.5 s on each of 2 H100s: 8 samples/s and 56 tokens/s per device,
    twice that in total, 8e12 FLOP/s per device and an MFU of 8e12 / 989e12 (the H100's dense bf16 peak)."""
    from mmlight.callbacks import Throughput

    trainer, task, shown, synced = stand_ins(monkeypatch, [10.0, 10.5, 11.0, 11.5, 12.0])
    callback = Throughput(window_size=3)
    callback.setup(trainer, task, "fit")
    callback.on_train_start(trainer, task)
    train_batches(callback, trainer, task, 4)
    logger = trainer.loggers[0]
    assert [step for step, _ in logger.logged] == [0, 0, 1, 2, 3]  # FLOPs per sample, then each step's rates
    assert logger.logged[0][1] == {"train/flops_per_sample": PER_SAMPLE}
    assert logger.logged[1][1] == {"train/time": 0.5, "train/batches": 1, "train/samples": 4, "train/lengths": 28}
    want = {
        "train/time": 2.0,
        "train/batches": 4,
        "train/samples": 16,
        "train/lengths": 112,
        "train/device/batches_per_sec": 2.0,  # 2 batches in the window's 1 s
        "train/batches_per_sec": 4.0,
        "train/device/samples_per_sec": 8.0,
        "train/samples_per_sec": 16.0,
        "train/device/items_per_sec": 56.0,
        "train/items_per_sec": 112.0,
        "train/device/flops_per_sec": 8 * PER_SAMPLE,
        "train/flops_per_sec": 16 * PER_SAMPLE,
        "train/device/mfu": 8 * PER_SAMPLE / 989e12,
    }
    assert logger.logged[-1][1] == pytest.approx(want, rel=1e-12)
    assert shown == {"samples/s": 16.0, "tokens/s": 112.0}  # the progress bar: all devices
    assert synced == [torch.device("cuda", 0)] * 5  # every reading of the clock waited for the GPU
    with caplog.at_level("INFO"):
        callback.on_train_end(trainer, task)
    # after the first batch: 3 batches x 4 samples x 2 devices in 1.5 s
    assert "mean throughput: 16.0 samples/s on 2 device(s), 112.0 tokens/s, 1e+12 FLOPs per sample, MFU 0.8%" in (
        caplog.text
    )


@pytest.mark.parametrize("name, peak", [("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA H200", 989e12)])
def test_mfu_is_against_the_peak_of_the_device_named(monkeypatch, name, peak):
    from mmlight.callbacks import Throughput

    trainer, task, _, _ = stand_ins(monkeypatch, [0.0, 1.0, 2.0], world_size=1, name=name, tokens=False)
    callback = Throughput(window_size=2)
    callback.setup(trainer, task, "fit")
    callback.on_train_start(trainer, task)
    train_batches(callback, trainer, task, 2)
    metrics = trainer.loggers[0].logged[-1][1]
    assert metrics["train/device/mfu"] == pytest.approx(4 * PER_SAMPLE / peak, rel=1e-12)
    assert "train/lengths" not in metrics and "train/device/items_per_sec" not in metrics  # no tokens counted
    assert "train/samples_per_sec" not in metrics  # one device: no totals


def test_validation_time_is_left_out_of_training_and_logged_by_its_own_count(monkeypatch):
    """Training's clock skips from its latest batch to validation's last one; validation logs its samples/s
    (no FLOPs) at every log_every_n_steps-th batch, under the count of validation batches of the fit."""
    from mmlight.callbacks import Throughput

    times = [10.0, 11.0, 12.0, 60.0, 60.5, 61.0, 61.5, 13.0 + 49.5, 14.0 + 49.5]
    trainer, task, _, _ = stand_ins(monkeypatch, times, world_size=1, device="cpu", tokens=False)
    trainer.log_every_n_steps = 2
    callback = Throughput(window_size=2)
    callback.setup(trainer, task, "fit")
    callback.on_train_start(trainer, task)
    train_batches(callback, trainer, task, 2)  # 1 s a batch
    callback.on_validation_start(trainer, task)  # 48 s after training's latest batch
    for _ in range(3):
        callback.on_validation_batch_end(trainer, task, None, {"n": 4}, 0)  # 0.5 s a batch
    callback.on_validation_end(trainer, task)
    train_batches(callback, trainer, task, 2)  # 1 s a batch again, on the clock that went on
    logged = trainer.loggers[0].logged
    validation = [(step, m) for step, m in logged if "validate/samples" in m]
    assert validation == [
        (
            2,
            {
                "validate/time": 1.0,
                "validate/batches": 2,
                "validate/samples": 8,
                "validate/device/batches_per_sec": 2.0,
                "validate/device/samples_per_sec": 8.0,
            },
        )
    ]
    train = [(step, m) for step, m in logged if "train/samples" in m]
    assert [step for step, _ in train] == [1, 3]  # steps 2 and 4
    assert train[-1][1]["train/time"] == pytest.approx(4.0) and train[-1][1]["train/device/samples_per_sec"] == 4.0


def test_between_accumulated_batches_and_with_logging_off_nothing_is_logged(monkeypatch):
    from mmlight.callbacks import Throughput

    trainer, task, shown, _ = stand_ins(monkeypatch, [0.0, 1.0, 2.0, 3.0, 4.0], device="cpu")
    callback = Throughput(window_size=2)
    callback.setup(trainer, task, "fit")
    callback.on_train_start(trainer, task)
    train_batches(callback, trainer, task, 2, step=False)  # accumulating: no optimiser step yet
    assert [m for _, m in trainer.loggers[0].logged] == [{"train/flops_per_sample": PER_SAMPLE}] and shown == {}
    trainer.log_every_n_steps = 0
    train_batches(callback, trainer, task, 2)
    assert len(trainer.loggers[0].logged) == 1 and shown == {}
    assert callback.last == (4.0, 16, 112)  # counted all the same


def test_a_fit_of_no_batch_or_one_batch_prints_no_mean(monkeypatch, caplog):
    """The end-of-fit mean is over the batches after the first: a fit that trained no batch (resumed at its
    end) or one batch has no time to divide by, and prints nothing."""
    from mmlight.callbacks import Throughput

    for batches in (0, 1):
        trainer, task, _, _ = stand_ins(monkeypatch, [0.0, 1.0], world_size=1, device="cpu")
        callback = Throughput(window_size=2)
        callback.setup(trainer, task, "fit")
        callback.on_train_start(trainer, task)
        train_batches(callback, trainer, task, batches)
        with caplog.at_level("INFO"):
            callback.on_train_end(trainer, task)
        assert "mean throughput" not in caplog.text
        assert callback.last == (None if batches == 0 else (1.0, 4, 28))


def test_window_size_is_checked():
    from mmlight.callbacks import Throughput

    with pytest.raises(ValueError, match="window_size must be at least 2 .*got 1"):
        Throughput(window_size=1)
    assert Throughput().window_size == 10


@pytest.mark.parametrize("stage, hook", [("validate", "validation"), ("test", "test"), ("predict", "predict")])
def test_evaluations_log_their_rates_by_their_own_batch_count(monkeypatch, stage, hook):
    """``mmlight validate``, ``test`` and ``predict``: samples/s (no FLOPs: the count is of a training step)
    under the stage's name at every log_every_n_steps-th batch, the step being the batches seen; a second call
    counts anew."""
    from mmlight.callbacks import Throughput

    trainer, task, _, _ = stand_ins(monkeypatch, [5.0, 5.5, 6.0, 6.5, 7.0, 7.5], world_size=1, device="cpu")
    trainer.state.fn, trainer.log_every_n_steps = stage, 2
    callback = Throughput(window_size=3)
    for _ in range(2):
        callback.setup(trainer, task, stage)
        getattr(callback, f"on_{hook}_start")(trainer, task)
        for _ in range(2):
            getattr(callback, f"on_{hook}_batch_end")(trainer, task, None, {"n": 4}, 0)
        getattr(callback, f"on_{hook}_end", lambda *args: None)(trainer, task)  # no training to shift
    assert (
        trainer.loggers[0].logged
        == [(2, {f"{stage}/time": 1.0, f"{stage}/batches": 2, f"{stage}/samples": 8, f"{stage}/lengths": 56})] * 2
    )  # the window of 3 is not full after 2 batches: no rate yet
    assert callback.flops_per_sample is None


def test_sanity_checking_and_a_task_without_the_protocol_count_nothing(monkeypatch):
    from mmlight.callbacks import Throughput

    trainer, task, _, _ = stand_ins(monkeypatch, [], world_size=1, device="cpu")  # the clock is never read
    trainer.sanity_checking = True
    callback = Throughput(window_size=2)
    callback.setup(trainer, task, "fit")
    callback.on_validation_start(trainer, task)
    callback.on_validation_batch_end(trainer, task, None, {"n": 4}, 0)
    callback.on_validation_end(trainer, task)
    assert callback.meters == {} and trainer.loggers[0].logged == []
    trainer.sanity_checking = False
    with pytest.warns(UserWarning, match="SimpleNamespace has no batch_counts"):
        callback.setup(trainer, SimpleNamespace(counts_tokens=False, training_loss=None), "fit")
    callback.on_train_start(trainer, task)
    train_batches(callback, trainer, task, 2)
    callback.on_train_end(trainer, task)
    assert callback.disabled and callback.meters == {} and trainer.loggers[0].logged == []


def test_a_validation_without_batches_shifts_training_by_the_time_to_its_start(monkeypatch):
    """No validation batch: training's clock skips from its latest batch to the validation's start."""
    from mmlight.callbacks import Throughput

    trainer, task, _, _ = stand_ins(monkeypatch, [10.0, 11.0, 30.0, 32.0], world_size=1, device="cpu", tokens=False)
    callback = Throughput(window_size=2)
    callback.setup(trainer, task, "fit")
    callback.on_train_start(trainer, task)
    train_batches(callback, trainer, task, 1)  # ends at 1 s
    callback.on_validation_start(trainer, task)  # at 30: 19 s after it, and no batch
    callback.on_validation_end(trainer, task)
    train_batches(callback, trainer, task, 1)  # at 32: 2 s after the validation started
    assert callback.meters["train"].elapsed == 3.0 and callback.last == (3.0, 8, 0)
