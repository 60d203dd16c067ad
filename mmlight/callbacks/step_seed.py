"""Random draws of a training step as a function of the seed and the step's position."""

from __future__ import annotations

import random

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from mmlight.data.streaming import run_seed


class StepSeed(Callback):
    """Before every training batch, seed Python's, NumPy's and torch's generators (CPU and every
    GPU) from ``(seed, epoch, batch index, rank)``. Dropout, drop-path and mixup/cutmix (timm's
    ``Mixup`` draws from ``np.random``) then depend on where the step is in the run and not on what
    ran before it in the process, so a run resumed from a checkpoint draws what an uninterrupted run
    draws at the same step. The seed is ``seed_everything``'s.
    """

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        entropy = [run_seed(), trainer.current_epoch, batch_idx, trainer.global_rank]
        words = np.random.SeedSequence(entropy).generate_state(2, np.uint32)
        seed = int(words[0]) << 32 | int(words[1])
        random.seed(seed)
        np.random.seed(int(words[0]))
        torch.manual_seed(seed)
