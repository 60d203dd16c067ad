"""A callback for the DDP test: each rank writes what it saw (steps, validation samples, metrics)
to ``$MMLIGHT_PROBE_DIR/rank<r>-<stage>.json``."""

import json
import os
from pathlib import Path

import lightning as L


class Probe(L.Callback):
    def __init__(self):
        self.val_samples = 0
        self.train_batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train_batches += 1

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.val_samples += len(batch[1]) if isinstance(batch, (list, tuple)) else len(batch["ids"])

    def _write(self, trainer, stage):
        record = {
            "global_step": trainer.global_step,
            "train_batches": self.train_batches,
            "val_samples": self.val_samples,
            "world_size": trainer.world_size,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val/", "test/"))},
        }
        path = Path(os.environ["MMLIGHT_PROBE_DIR"]) / f"rank{trainer.global_rank}-{stage}.json"
        path.write_text(json.dumps(record))

    def on_fit_end(self, trainer, pl_module):
        self._write(trainer, "fit")

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "validate":
            self._write(trainer, "validate")

    def on_test_end(self, trainer, pl_module):
        self._write(trainer, "test")
