"""FinalMetrics: the last validation's metrics, printed once when fit ends (stand-in trainer)."""

from types import SimpleNamespace

import torch

from mmlight.callbacks import FinalMetrics


def test_prints_every_val_metric_sorted_with_epoch_and_step(capsys):
    metrics = {"val/top1": torch.tensor(0.512345), "train/loss": torch.tensor(2.0), "val/loss": torch.tensor(1.5),
               "val/ema_top1": torch.tensor(0.25)}
    FinalMetrics().on_fit_end(SimpleNamespace(callback_metrics=metrics, current_epoch=3, global_step=40), None)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Final validation metrics (epoch 3, step 40):"
    assert [line.split() for line in lines[1:]] == [["val/ema_top1", "0.2500"], ["val/loss", "1.5000"],
                                                    ["val/top1", "0.5123"]]


def test_prefix_selects_and_nothing_is_printed_without_metrics(capsys):
    trainer = SimpleNamespace(callback_metrics={"train/loss": torch.tensor(2.0)}, current_epoch=0, global_step=1)
    FinalMetrics().on_fit_end(trainer, None)
    assert capsys.readouterr().out == ""
    FinalMetrics(prefix="train/").on_fit_end(trainer, None)
    assert capsys.readouterr().out.splitlines()[1].split() == ["train/loss", "2.0000"]
