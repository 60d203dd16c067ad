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
    return (
        random.random(),
        float(np.random.rand()),
        float(torch.rand(1)),
        float(torch.nn.functional.dropout(torch.ones(64), 0.5).sum()),
    )


def test_draws_are_a_function_of_the_position(monkeypatch):
    reference = draws(0, 1, 5, 0, monkeypatch)
    assert draws(0, 1, 5, 0, monkeypatch) == reference
    for other in [(1, 1, 5, 0), (0, 2, 5, 0), (0, 1, 6, 0), (0, 1, 5, 1)]:
        assert all(a != b for a, b in zip(draws(*other, monkeypatch)[:3], reference[:3])), other


def test_generators_are_seeded_from_the_seed_sequence_of_the_position(monkeypatch):
    """Python's and torch's generators get the 64-bit number of SeedSequence([seed, epoch, batch, rank])'s
    first two 32-bit words, NumPy's legacy one the first word (it takes 32 bits): hand-seeded copies draw
    the same. (The derivation is part of every run's draws: changing it changes resumed runs.)"""
    high, low = np.random.SeedSequence([3, 1, 5, 2]).generate_state(2, np.uint32)
    seed = int(high) * 2**32 + int(low)
    want = (
        random.Random(seed).random(),
        float(np.random.RandomState(int(high)).rand()),
        float(torch.rand(1, generator=torch.Generator().manual_seed(seed))),
    )
    assert draws(3, 1, 5, 2, monkeypatch)[:3] == want


def test_every_gpu_is_seeded_with_the_same_number(monkeypatch):
    """Dropout on a GPU draws from that device's generator: StepSeed seeds all of them (torch.manual_seed
    calls torch.cuda.manual_seed_all), with the number the CPU generator gets; the loaders' per-unit
    seeding (every_device=False) leaves them alone."""
    from mmlight.data.streaming import seed_global_generators

    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    high, low = np.random.SeedSequence([3, 1, 5, 2]).generate_state(2, np.uint32)
    draws(3, 1, 5, 2, monkeypatch)
    assert seeded == [int(high) * 2**32 + int(low)]
    seed_global_generators([3, 1, 5, 2])
    assert len(seeded) == 1
