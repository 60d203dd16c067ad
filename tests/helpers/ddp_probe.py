"""A callback for the DDP tests: each rank writes what it saw (steps, validation samples, metrics)
to ``$MMLIGHT_PROBE_DIR/rank<r>-<stage>.json``; :func:`run_probed` runs ``mmlight`` with it."""

import json
import os
from pathlib import Path

import lightning as L

from tests.helpers.cli import mmlight_in_process, run_mmlight

ROOT = Path(__file__).resolve().parents[2]


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


def run_probed(args: list[str], probe_dir: Path, cwd: Path, processes: int, timeout: float = 400) -> None:
    """``mmlight ARGS`` with :class:`Probe` writing its records to ``probe_dir``.

    Args:
        args: the command line after ``mmlight``.
        probe_dir: where each rank writes ``rank<r>-<stage>.json``.
        cwd: the working directory of the run.
        processes: more than one (DDP) starts ``python -m mmlight.cli`` in a new interpreter with one
            thread, as a user's run does; one runs in this process.
        timeout: seconds the new interpreter may take.
    """
    probe_dir.mkdir(parents=True, exist_ok=True)
    args = [*args, "--trainer.callbacks+=tests.helpers.ddp_probe.Probe"]
    if processes == 1:
        mmlight_in_process(*args, cwd=cwd, env={"MMLIGHT_PROBE_DIR": str(probe_dir)})
        return
    env = {**os.environ, "MMLIGHT_PROBE_DIR": str(probe_dir), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    result = run_mmlight(*args, cwd=cwd, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
