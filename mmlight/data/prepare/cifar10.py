"""CIFAR-10 from the official python pickles (see :mod:`mmlight.data.prepare.cifar`)."""

from __future__ import annotations

from pathlib import Path

from mmlight.data.prepare.cifar import CIFAR10, prepare_release

NEEDS_SRC = True


def prepare(src: Path, out: Path, workers: int) -> dict:
    """Write the CIFAR-10 ``train``/``test`` shards and ``_info.json``."""
    return prepare_release(src, out, workers, CIFAR10)
