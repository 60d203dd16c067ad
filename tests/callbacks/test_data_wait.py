"""DataWaitMonitor on a real (CPU) fit: a loader worker that sleeps more than the step warns once with
the measured share; a step that sleeps more than the loader does not. The advice fits the run: GPUs and
loader workers are named only where they apply, and CPU training with in-process loading is quiet."""

import re
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from mmlight.callbacks import DataWaitMonitor
from mmlight.cli import build_cli
from tests.helpers.trainer import quiet_trainer


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


class SleepyDataModule(L.LightningDataModule):
    def __init__(self, sleep_s: float, num_workers: int):
        super().__init__()
        self.sleep_s, self.num_workers = sleep_s, num_workers

    def train_dataloader(self):
        return torch.utils.data.DataLoader(SleepyData(self.sleep_s), batch_size=1, num_workers=self.num_workers)


def fit(fetch_s: float, step_s: float, num_workers: int = 1) -> tuple[DataWaitMonitor, list[str]]:
    monitor = DataWaitMonitor(max_wait_share=0.5, warmup=2, window=5)
    trainer = quiet_trainer(max_steps=12, callbacks=[monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SleepyStep(step_s), datamodule=SleepyDataModule(fetch_s, num_workers))
    return monitor, [str(w.message) for w in caught if "waited on the data loader" in str(w.message)]


def test_slow_loader_warns_once_with_the_measured_share():
    # a 100 ms fetch against a step of ~1 ms (tens of ms on a machine loaded by other work or xdist workers)
    monitor, messages = fit(fetch_s=0.1, step_s=0.0)
    assert monitor.measured == 5 and monitor.wait_share() > 0.8
    assert len(messages) == 1 and f"{monitor.wait_share():.0%} of the time over 5 steps" in messages[0]
    assert "the loader (1 workers) does not keep up" in messages[0] and "GPU" not in messages[0]


def test_cpu_training_with_in_process_loading_is_quiet():
    """The same slow fetch in the training process on the CPU: loading is the step's own work, not a wait."""
    monitor, messages = fit(fetch_s=0.1, step_s=0.0, num_workers=0)
    assert monitor.measured == 5 and monitor.wait_share() > 0.8 and messages == []


def test_fast_loader_is_quiet():
    # a 150 ms step, so that a fetch slowed by a loaded machine (tens of ms) stays far below the bound
    monitor, messages = fit(fetch_s=0.0, step_s=0.15)
    assert monitor.measured == 5 and monitor.wait_share() < 0.2 and messages == []


def test_bad_arguments_are_refused():
    """Each bound, at and just past its edge, with the value in the message; edge values inside are kept."""
    for share in (0, 1, 1.5, -0.1):
        with pytest.raises(ValueError, match=re.escape(f"max_wait_share must be in (0, 1), got {share}")):
            DataWaitMonitor(max_wait_share=share)
    for warmup, window in ((0, 5), (5, 0), (-1, 5)):
        with pytest.raises(ValueError, match=re.escape(f"warmup and window must be >= 1, got {warmup} and {window}")):
            DataWaitMonitor(warmup=warmup, window=window)
    monitor = DataWaitMonitor(max_wait_share=0.999, warmup=1, window=1)
    assert (monitor.max_wait_share, monitor.warmup, monitor.window) == (0.999, 1, 1)
    default = DataWaitMonitor()
    assert (default.max_wait_share, default.warmup, default.window) == (0.1, 20, 50)
    counters = (default.steps_seen, default.measured, default.wait_s, default.step_s, default.done)
    assert counters == (0, 0, 0.0, 0.0, False)
    assert default.batch_ended_at is None and default.batch_started_at is None


def drive(monkeypatch, datamodule, times, epoch_break=False, device="cuda"):
    """The hooks of four training batches on a clock that reads ``times`` (start and end of each batch)
    of a run on ``device``; ``epoch_break``: a new epoch starts before the second batch. Returns the
    monitor and its warnings."""
    import mmlight.callbacks.data_wait as data_wait

    clock = iter(times)
    monkeypatch.setattr(data_wait.time, "perf_counter", lambda: next(clock))
    monitor = DataWaitMonitor(max_wait_share=0.5, warmup=1, window=2)
    trainer = SimpleNamespace(datamodule=datamodule, strategy=SimpleNamespace(root_device=torch.device(device)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.on_fit_start(trainer, None)
        monitor.on_train_epoch_start(trainer, None)
        for i in range(4):
            if epoch_break and i == 1:
                monitor.on_train_epoch_start(trainer, None)
            monitor.on_train_batch_start(trainer, None, None, i)
            monitor.on_train_batch_end(trainer, None, None, None, i)
    return monitor, [str(w.message) for w in caught]


def test_the_warning_gives_the_measured_figures_and_the_workers_that_would_keep_up(monkeypatch):
    """Batch 0 is warm-up; batches 1 and 2 wait 3 s each for a 1 s step: 75% waiting; with 2 workers
    delivering one batch per 4 s, ceil(2 x 8 / 2) = 8 workers would deliver one per step. Batch 3 is
    not timed (the clock would run out)."""
    monitor, messages = drive(monkeypatch, SimpleNamespace(num_workers=2), [1.0, 4.0, 5.0, 8.0, 9.0])
    assert (monitor.measured, monitor.wait_s, monitor.step_s, monitor.wait_share()) == (2, 6.0, 2.0, 0.75)
    assert messages == [
        "The training step waited on the data loader for 75% of the time over 2 steps (fetch 3000.0 ms, step "
        "1000.0 ms per batch; threshold 50%): the input pipeline, not the GPU, sets the speed. With 2 "
        "workers per device now, about 8 would keep up (data.num_workers, and as many CPUs per task). See "
        "BENCHMARKS.md, 'Image loader', for the cores one GPU needs."
    ]
    for datamodule in (None, SimpleNamespace()):  # no worker count: no worker advice
        _, messages = drive(monkeypatch, datamodule, [1.0, 4.0, 5.0, 8.0, 9.0])
        assert len(messages) == 1 and messages[0].endswith(
            "threshold 50%): the input pipeline, not the GPU, sets the "
            "speed. See BENCHMARKS.md, 'Image loader', for the cores "
            "one GPU needs."
        )


def test_the_device_kind_is_the_strategy_s_root_device_type_and_the_cpu_without_one():
    from mmlight.callbacks.data_wait import device_kind

    on_meta = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("meta")))
    assert device_kind(on_meta) == "meta"
    # a trainer without a strategy, or a strategy without a root device (not yet set up)
    assert device_kind(SimpleNamespace()) == device_kind(SimpleNamespace(strategy=SimpleNamespace())) == "cpu"


def test_the_advice_names_gpus_and_workers_only_where_they_apply(monkeypatch):
    """Same clock as above (75% waiting): in-process loading on a GPU asks for workers; another accelerator
    is named by its device type, without the GPU figures; the CPU names neither GPUs nor BENCHMARKS.md, and
    with in-process loading (or no worker count) says nothing."""
    times = [1.0, 4.0, 5.0, 8.0, 9.0]
    _, messages = drive(monkeypatch, SimpleNamespace(num_workers=0), times)
    assert len(messages) == 1 and messages[0].endswith(
        "threshold 50%): the batches are loaded in the training process (data.num_workers 0), and the GPU idles "
        "meanwhile. Loader workers (data.num_workers, and as many CPUs per task) would load them during the step."
    )
    _, messages = drive(monkeypatch, SimpleNamespace(num_workers=2), times, device="mps")
    assert len(messages) == 1 and messages[0].endswith(
        "the input pipeline, not the accelerator (mps), sets the speed. With 2 workers per device now, about 8 "
        "would keep up (data.num_workers, and as many CPUs per task)."
    )
    _, messages = drive(monkeypatch, SimpleNamespace(num_workers=2), times, device="cpu")
    assert len(messages) == 1 and messages[0].endswith(
        "threshold 50%): the loader (2 workers) does not keep up with the step. On the CPU the workers share the "
        "cores with it: about 8 would keep up, if the machine has cores to spare (data.num_workers)."
    )
    for datamodule in (None, SimpleNamespace(num_workers=0), SimpleNamespace()):
        monitor, messages = drive(monkeypatch, datamodule, times, device="cpu")
        assert monitor.wait_share() == 0.75 and messages == []


def test_the_gap_across_an_epoch_start_is_not_a_fetch_and_a_share_at_the_threshold_is_quiet(monkeypatch):
    # batch 1 follows a new epoch: not timed; batches 2 and 3 wait 1 s for a 1 s step: exactly 50%
    monitor, messages = drive(monkeypatch, None, [1.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0], epoch_break=True)
    assert (monitor.measured, monitor.wait_s, monitor.step_s, monitor.done) == (2, 2.0, 2.0, True)
    assert messages == []
    assert DataWaitMonitor().wait_share() == 0.0  # nothing measured yet


def test_warmup_counts_every_step_and_short_steps_give_the_right_worker_count(monkeypatch):
    """warmup 3: batches 0-2 untimed, 3 and 4 timed (the window); 0.125 s steps after 0.375 s waits
    (binary fractions: exact sums): ceil(4 x 1.0 / 0.25) = 16 workers would keep up."""
    import mmlight.callbacks.data_wait as data_wait

    # the clock is read at the end of every batch, and at the start of a timed one
    clock = iter([0.0, 0.125, 0.25, 0.625, 0.75, 1.125, 1.25])  # ends of 0-2; start, end of 3; start, end of 4
    monkeypatch.setattr(data_wait.time, "perf_counter", lambda: next(clock))
    monitor = DataWaitMonitor(max_wait_share=0.5, warmup=3, window=2)
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(num_workers=4), strategy=SimpleNamespace(root_device=torch.device("cuda"))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.on_fit_start(trainer, None)
        monitor.on_train_epoch_start(trainer, None)
        for i in range(5):
            monitor.on_train_batch_start(trainer, None, None, i)
            monitor.on_train_batch_end(trainer, None, None, None, i)
    assert monitor.steps_seen == 5 and monitor.measured == 2
    assert (monitor.wait_s, monitor.step_s) == (0.75, 0.25)
    assert len(caught) == 1 and "With 4 workers per device now, about 16 would keep up" in str(caught[0].message)


QUICKSTARTS = sorted((Path(__file__).resolve().parents[2] / "configs" / "quickstart").glob("*.yaml"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One cache for the generated data sets of the quick starts (written on first use)."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow
@pytest.mark.parametrize("config", QUICKSTARTS, ids=lambda p: p.name)
def test_no_loader_warning_on_the_quick_starts_as_shipped(config, cache_dir, tmp_path, monkeypatch):
    """The first steps of each quick start, as shipped (its loader settings untouched), with a second
    monitor that measures from the second step and holds a 0.01% threshold: the loading share is above
    it, so only the rule for in-process loading on the CPU keeps the run quiet. Validation is left out.
    The translation corpus is generated at 2,000 training pairs instead of 20,000 (its preparation was
    most of this test's time; 4 steps of 2,048 tokens need far fewer)."""
    monkeypatch.setattr(sys, "argv", ["mmlight"])
    task = config.stem.split("_")[0]
    if task == "llm":  # prepared text: a small python-docs shard set replaces data/python-docs
        from tests.helpers.text_fixtures import python_docs_shards

        cache = ["--data.init_args.root", str(python_docs_shards(tmp_path / "python-docs"))]
    else:  # recall is generated in memory, the other quick starts write a cache
        cache = [] if task == "lm" else ["--data.init_args.cache_dir", str(cache_dir / task)]
    if task == "nmt":  # the corpus's size, not the loader's settings (max_tokens, workers as shipped)
        cache += ["--data.init_args.train_size", "2000", "--data.init_args.valid_size", "20"]
        cache += ["--data.init_args.test_size", "20"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = build_cli(
            [
                "fit",
                "--config",
                str(config),
                "--trainer.max_steps",
                "4",
                "--trainer.limit_val_batches",
                "0",
                "--trainer.default_root_dir",
                str(tmp_path),
                "--trainer.logger.init_args.save_dir",
                str(tmp_path),
                *cache,
                "--trainer.callbacks+=mmlight.callbacks.DataWaitMonitor",
                "--trainer.callbacks.max_wait_share",
                "0.0001",
                "--trainer.callbacks.warmup",
                "1",
                "--trainer.callbacks.window",
                "2",
            ]
        )
    monitors = [c for c in cli.trainer.callbacks if isinstance(c, DataWaitMonitor)]
    assert sorted(m.max_wait_share for m in monitors) == [0.0001, 0.1]  # this test's and the shipped one
    [strict] = [m for m in monitors if m.max_wait_share == 0.0001]
    assert strict.done and strict.measured == 2 and strict.wait_share() > strict.max_wait_share
    assert cli.datamodule.num_workers == 0 and cli.trainer.strategy.root_device.type == "cpu"
    assert [str(w.message) for w in caught if "waited on the data loader" in str(w.message)] == []
