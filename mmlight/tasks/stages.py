"""The validation and test hooks of every task, routed to one pair of methods per task."""

from __future__ import annotations


class EvalStages:
    """Mixin placed before ``LightningModule``: validation and test run ``_eval_step(stage, batch)`` per
    batch and ``_eval_epoch_end(stage)`` once per epoch, with ``stage`` ``"val"`` or ``"test"``.
    ``_eval_epoch_end`` runs on every rank, also one that saw no batch, so metric syncs there are safe."""

    def validation_step(self, batch, batch_idx):
        self._eval_step("val", batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch, batch_idx):
        self._eval_step("test", batch)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")
