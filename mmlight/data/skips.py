"""Counting samples that fail to decode while streaming, across DataLoader worker processes.

A corrupt sample met mid-epoch is skipped, never a crash and never silence: the decode step catches
the error, logs the sample's key and shard, and increments a counter in shared memory that every
worker of the DataModule inherits. :class:`mmlight.callbacks.SkippedSamplesMonitor` logs the running
count (summed over ranks) to TensorBoard.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class SkipCounter:
    """A process-shared count of skipped samples (created before the workers start)."""

    def __init__(self):
        self._value = multiprocessing.get_context().Value("q", 0)

    def add(self, n: int = 1) -> None:
        with self._value.get_lock():
            self._value.value += n

    @property
    def value(self) -> int:
        return int(self._value.value)


class Skipping:
    """Wrap a per-sample decode ``fn``: on any error, log the sample's key and shard, count it, and
    return None (the pipeline drops None with ``.select(is_kept)``). A class rather than a closure,
    so the pipeline pickles for worker processes started by spawn or forkserver.

    Args:
        fn: sample dict -> decoded sample.
        counter: where skips are counted.
    """

    def __init__(self, fn: Callable[[dict], Any], counter: SkipCounter):
        self.fn = fn
        self.counter = counter

    def __call__(self, sample: dict) -> Any:
        try:
            return self.fn(sample)
        except Exception as err:  # a corrupt sample may raise anything from PIL, numpy, int()...
            self.counter.add()
            log.warning(
                "skipped corrupt sample %s in %s: %s: %s",
                sample.get("__key__"),
                sample.get("__url__"),
                type(err).__name__,
                err,
            )
            return None


def is_kept(sample: Any) -> bool:
    return sample is not None
