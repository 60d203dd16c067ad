"""DataWaitMonitor on a real (CPU) fit: a loader that sleeps more than the step warns once with
the measured share; a step that sleeps more than the loader does not."""

import time
import warnings

import lightning as L
import pytest
import torch

from mmlight.callbacks import DataWaitMonitor


class SleepyData(torch.utils.data.Dataset):
    def __init__(self, sleep_s: float):
        self.sleep_s = sleep_s

    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return torch.ones(2)


class SleepyStep(L.LightningModule):
    def __init__(self, sleep_s: float):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.sleep_s = sleep_s

    def training_step(self, batch, batch_idx):
        time.sleep(self.sleep_s)
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(fetch_s: float, step_s: float) -> tuple[DataWaitMonitor, list[str]]:
    monitor = DataWaitMonitor(max_wait_share=0.5, warmup=2, window=5)
    trainer = L.Trainer(accelerator="cpu", max_steps=12, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])
    loader = torch.utils.data.DataLoader(SleepyData(fetch_s), batch_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SleepyStep(step_s), loader)
    return monitor, [str(w.message) for w in caught if "waited on the data loader" in str(w.message)]


def test_slow_loader_warns_once_with_the_measured_share():
    monitor, messages = fit(fetch_s=0.03, step_s=0.0)
    assert monitor.measured == 5 and monitor.wait_share() > 0.8  # 30 ms fetch against a ~1 ms step
    assert len(messages) == 1 and f"{monitor.wait_share():.0%} of the time over 5 steps" in messages[0]


def test_fast_loader_is_quiet():
    monitor, messages = fit(fetch_s=0.0, step_s=0.03)
    assert monitor.measured == 5 and monitor.wait_share() < 0.2 and messages == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_wait_share"):
        DataWaitMonitor(max_wait_share=1.5)
