"""The rich progress bar, with steps out of ``max_steps`` for step-limited runs."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """Lightning's :class:`~lightning.pytorch.callbacks.RichProgressBar`, except that a run limited by
    ``max_steps`` alone (``max_epochs: -1``, as the LM and NMT configs) shows ``Epoch 7, step
    5200/50000`` instead of ``Epoch 7/-2``. Takes ``RichProgressBar``'s arguments."""

    def _step_limited(self) -> bool:
        return self.trainer.max_epochs is None or self.trainer.max_epochs < 0

    def _get_train_description(self, current_epoch: int) -> str:
        if not self._step_limited():
            return super()._get_train_description(current_epoch)
        max_steps = self.trainer.max_steps
        description = f"Epoch {current_epoch}, step {self.trainer.global_step}"
        description += f"/{max_steps}" if max_steps is not None and max_steps >= 0 else ""
        return f"{description:{len(self.validation_description)}}"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._step_limited() and self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(
                self.train_progress_bar_id, description=self._get_train_description(trainer.current_epoch)
            )
