"""Warns once, early in ``fit``, when the training step waits on the data loader: on an accelerator,
too few loader workers or CPUs to feed it; on the CPU, loader workers that do not keep up. Training on
the CPU with the batches loaded in the training process (``num_workers: 0``, as the quick starts do)
has nothing to wait on: loading is part of the step's work on the same cores, and nothing is said."""

from __future__ import annotations

import logging
import math
import time

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

log = logging.getLogger(__name__)


class DataWaitMonitor(L.Callback):
    """Times the gap between one training batch's end and the next one's start (the loader fetch,
    plus the copy to the device) against the step itself, over ``window`` steps after ``warmup``
    steps (worker start-up, first compilations), once per ``fit``. When the wait exceeds
    ``max_wait_share`` of the time, warns on rank 0 with the measured figures and advice that fits the
    run (see :func:`advice`). Costs two clock reads per step in the window and nothing after it.

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
        figures = (
            f"The training step waited on the data loader for {share:.0%} of the time over {measured} steps "
            f"(fetch {1e3 * self.wait_s / measured:.1f} ms, step {1e3 * self.step_s / measured:.1f} ms "
            f"per batch; threshold {self.max_wait_share:.0%})"
        )
        workers = getattr(trainer.datamodule, "num_workers", None) if trainer.datamodule is not None else None
        text = advice(device_kind(trainer), workers, self.wait_s, self.step_s)
        if text is None:
            log.debug("%s; the batches are loaded in the training process on the CPU, so this is not a wait.", figures)
            return
        rank_zero_warn(f"{figures}: {text}")


def device_kind(trainer) -> str:
    """``"cpu"``, ``"cuda"`` or another accelerator's device type, from the strategy's root device."""
    strategy = getattr(trainer, "strategy", None)
    device = getattr(strategy, "root_device", None)
    return device.type if device is not None else "cpu"


def advice(device: str, workers: int | None, wait_s: float, step_s: float) -> str | None:
    """What to do about a loader that the step waits on, for a run on ``device`` with ``workers``
    loader workers (None: the DataModule does not say). None where nothing applies: on the CPU with
    in-process loading (or no worker count), the "wait" is the step's own loading work, on the cores
    the step would use anyway."""
    # the loader delivers a batch per (wait + step); keeping up means one batch per step
    needed = math.ceil(workers * (wait_s + step_s) / max(step_s, 1e-9)) if workers else None
    if device == "cpu":
        if not workers:
            return None
        return (
            f"the loader ({workers} workers) does not keep up with the step. On the CPU the workers share the "
            f"cores with it: about {needed} would keep up, if the machine has cores to spare (data.num_workers)."
        )
    accelerator = "GPU" if device == "cuda" else f"accelerator ({device})"
    if workers == 0:
        return (
            f"the batches are loaded in the training process (data.num_workers 0), and the {accelerator} idles "
            f"meanwhile. Loader workers (data.num_workers, and as many CPUs per task) would load them during "
            f"the step."
        )
    text = f"the input pipeline, not the {accelerator}, sets the speed."
    if workers:
        text += (
            f" With {workers} workers per device now, about {needed} would keep up "
            f"(data.num_workers, and as many CPUs per task)."
        )
    if device == "cuda":
        text += " See BENCHMARKS.md, 'Image loader', for the cores one GPU needs."
    return text
