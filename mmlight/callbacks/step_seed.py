"""Random draws of a training step as a function of the seed and the step's position."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from mmlight.data.streaming import run_seed, seed_global_generators


class StepSeed(Callback):
    """Before every training batch, seed Python's, NumPy's and torch's generators (CPU and every
    GPU) from ``(seed, epoch, batch index, rank)``. Dropout, drop-path and mixup/cutmix (timm's
    ``Mixup`` draws from ``np.random``) then depend on where the step is in the run and not on what
    ran before it in the process, so a run resumed from a checkpoint draws what an uninterrupted run
    draws at the same step. The seed is ``seed_everything``'s.
    """

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        entropy = [run_seed(), trainer.current_epoch, batch_idx, trainer.global_rank]
        seed_global_generators(entropy, every_device=True)
