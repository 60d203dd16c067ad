"""Logs the running count of corrupt samples skipped by the DataModule (``datamodule.skipped``)."""

from __future__ import annotations

import lightning as L
import torch


class SkippedSamplesMonitor(L.Callback):
    """Logs ``data/skipped_samples``, summed over ranks, every ``log_every_n_steps`` training steps
    and after every validation epoch. Both points are reached by every rank at the same global step,
    so the sum cannot hang, and the training step pays for the scalar all-reduce only when the
    logger writes anyway. A DataModule without a ``skipped`` counter is ignored."""

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        counter = getattr(trainer.datamodule, "skipped", None)
        if counter is None:
            return
        count = torch.tensor(float(counter.value), device=pl_module.device)
        pl_module.log("data/skipped_samples", count, reduce_fx="sum", sync_dist=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            self._log(trainer, pl_module)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._log(trainer, pl_module)
