"""The periodic ``last.ckpt``: every N training steps *and* at the end of every epoch."""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint


class LastCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that keeps ``last.ckpt`` current: every ``every_n_train_steps`` steps
    (Lightning's trigger) and also at every epoch end, which Lightning skips once a step trigger is
    set, so that a finished run's ``last.ckpt`` holds its final state. Lightning writes it to a
    temporary file and renames it, so a killed process never leaves a half-written one.

    Takes :class:`~lightning.pytorch.callbacks.ModelCheckpoint`'s arguments.
    """

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
