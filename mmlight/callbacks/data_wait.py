"""Warns once, early in ``fit``, when the training step waits on the data loader (too few loader
workers or CPUs for the accelerator's rate)."""

from __future__ import annotations

import math
import time

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn


class DataWaitMonitor(L.Callback):
    """Times the gap between one training batch's end and the next one's start (the loader fetch,
    plus the copy to the device) against the step itself, over ``window`` steps after ``warmup``
    steps (worker start-up, first compilations), once per ``fit``. When the wait exceeds
    ``max_wait_share`` of the time, warns on rank 0 with the measured figures and the number of
    loader workers that would keep up at this rate. Costs two clock reads per step in the window and
    nothing after it.

    Args:
        max_wait_share: tolerated fraction of time spent waiting on data.
        warmup: training steps skipped before measuring.
        window: training steps measured.
    """

    def __init__(self, max_wait_share: float = 0.1, warmup: int = 20, window: int = 50):
        if not 0 < max_wait_share < 1:
            raise ValueError(f"max_wait_share must be in (0, 1), got {max_wait_share}")
        if warmup < 1 or window < 1:
            raise ValueError(f"warmup and window must be >= 1, got {warmup} and {window}")
        self.max_wait_share = max_wait_share
        self.warmup = warmup
        self.window = window
        self._reset()

    def _reset(self) -> None:
        self.steps_seen = 0
        self.measured = 0  # steps whose fetch and step were both timed
        self.wait_s = 0.0
        self.step_s = 0.0
        self.batch_ended_at: float | None = None
        self.batch_started_at: float | None = None  # None: this step is not timed
        self.done = False

    def on_fit_start(self, trainer, pl_module) -> None:
        self._reset()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.batch_ended_at = None  # the gap across epochs and validation is not a fetch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.done:
            return
        self.batch_started_at = None
        if self.batch_ended_at is not None and self.steps_seen >= self.warmup:
            self.batch_started_at = time.perf_counter()
            self.wait_s += self.batch_started_at - self.batch_ended_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.done:
            return
        now = time.perf_counter()
        self.steps_seen += 1
        if self.batch_started_at is not None:
            self.step_s += now - self.batch_started_at
            self.measured += 1
        self.batch_ended_at = now
        if self.measured >= self.window:
            self.done = True
            self._report(trainer)

    def wait_share(self) -> float:
        """Measured fraction of the time spent waiting for batches."""
        total = self.wait_s + self.step_s
        return self.wait_s / total if total > 0 else 0.0

    def _report(self, trainer) -> None:
        share = self.wait_share()
        if share <= self.max_wait_share:
            return
        measured = self.measured
        workers = getattr(trainer.datamodule, "num_workers", None) if trainer.datamodule is not None else None
        advice = ""
        if workers:  # the loader delivers a batch per (wait + step); keeping up means one per step
            needed = math.ceil(workers * (self.wait_s + self.step_s) / max(self.step_s, 1e-9))
            advice = f" With {workers} workers per device now, about {needed} would keep up (data.num_workers, and as many CPUs per task)."
        rank_zero_warn(
            f"The training step waited on the data loader for {share:.0%} of the time over {measured} steps "
            f"(fetch {1e3 * self.wait_s / measured:.1f} ms, step {1e3 * self.step_s / measured:.1f} ms per batch; "
            f"threshold {self.max_wait_share:.0%}): the input pipeline, not the accelerator, sets the speed."
            f"{advice} See BENCHMARKS.md, 'Image loader', for the cores one GPU needs."
        )
