"""StepSeed: a training step's random draws depend on (seed, epoch, batch index, rank) alone."""

import random
from types import SimpleNamespace

import numpy as np
import torch

from mmlight.callbacks import StepSeed


def draws(seed, epoch, batch_idx, rank, monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))
    random.random(), np.random.rand(), torch.rand(1)  # whatever ran before must not matter
    StepSeed().on_train_batch_start(SimpleNamespace(current_epoch=epoch, global_rank=rank), None, None, batch_idx)
    return random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.nn.functional.dropout(
        torch.ones(64), 0.5).sum())


def test_draws_are_a_function_of_the_position(monkeypatch):
    reference = draws(0, 1, 5, 0, monkeypatch)
    assert draws(0, 1, 5, 0, monkeypatch) == reference
    for other in [(1, 1, 5, 0), (0, 2, 5, 0), (0, 1, 6, 0), (0, 1, 5, 1)]:
        assert all(a != b for a, b in zip(draws(*other, monkeypatch)[:3], reference[:3])), other
