"""SkippedSamplesMonitor: what it logs, when, and with which reduction over ranks (stand-in trainer)."""

from types import SimpleNamespace

import pytest
import torch

from mmlight.callbacks import SkippedSamplesMonitor
from mmlight.data.skips import SkipCounter


def stand_ins(skipped: int | None, global_step=0, log_every_n_steps=50, sanity_checking=False):
    counter = None
    if skipped is not None:
        counter = SkipCounter()
        counter.add(skipped)
    calls = []
    module = SimpleNamespace(device=torch.device("cpu"), log=lambda *a, **k: calls.append((a, k)))
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(skipped=counter),
        global_step=global_step,
        log_every_n_steps=log_every_n_steps,
        sanity_checking=sanity_checking,
    )
    return trainer, module, calls


def logged(calls) -> list[tuple[str, float, dict]]:
    return [(a[0], a[1].item(), k) for a, k in calls]


@pytest.mark.parametrize(
    "step, every, logs", [(0, 50, True), (100, 50, True), (30, 50, False), (7, 1, True), (3, 0, True), (9, 4, False)]
)
def test_training_steps_log_the_running_count_every_n_steps(step, every, logs):
    trainer, module, calls = stand_ins(5, global_step=step, log_every_n_steps=every)
    SkippedSamplesMonitor().on_train_batch_end(trainer, module, None, None, 0)
    want = [("data/skipped_samples", 5.0, {"reduce_fx": "sum", "sync_dist": True})] if logs else []
    assert logged(calls) == want


def test_validation_end_logs_except_in_the_sanity_check():
    trainer, module, calls = stand_ins(3)
    SkippedSamplesMonitor().on_validation_epoch_end(trainer, module)
    assert logged(calls) == [("data/skipped_samples", 3.0, {"reduce_fx": "sum", "sync_dist": True})]
    trainer, module, calls = stand_ins(3, sanity_checking=True)
    SkippedSamplesMonitor().on_validation_epoch_end(trainer, module)
    assert calls == []


def test_a_datamodule_without_a_counter_is_ignored():
    trainer, module, calls = stand_ins(None)
    SkippedSamplesMonitor().on_validation_epoch_end(trainer, module)
    SkippedSamplesMonitor().on_train_batch_end(trainer, module, None, None, 0)
    trainer.datamodule = SimpleNamespace()  # no `skipped` attribute at all
    SkippedSamplesMonitor().on_validation_epoch_end(trainer, module)
    assert calls == []


def test_the_count_is_made_on_the_modules_device():
    """NCCL all-reduces only CUDA tensors: the count must be made on the module's device, not the CPU
    ("meta" stands in for a GPU here: a tensor made there says so)."""
    trainer, module, calls = stand_ins(4)
    module.device = torch.device("meta")
    SkippedSamplesMonitor().on_validation_epoch_end(trainer, module)
    (name, value), options = calls[0]
    assert name == "data/skipped_samples" and value.device == torch.device("meta") and value.shape == ()
