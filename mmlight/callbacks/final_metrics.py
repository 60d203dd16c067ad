"""The final metrics of a run, printed and written to ``final_metrics.json`` in its log folder.

``fit`` records every ``val/*`` value with the step and epoch of the validation that produced it,
the step training ended at, and the files of the best and last checkpoints. ``validate`` and
``test`` record their values with the checkpoint they evaluated and its step. ``mmlight collect``
reads these files (see :mod:`mmlight.experiments.table`), never the logs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

FILE_NAME = "final_metrics.json"


class FinalMetrics(L.Callback):
    """At the end of ``fit``, ``validate`` and ``test``: prints the last logged metrics of the stage
    with the step they come from, and writes them to ``<log_dir>/final_metrics.json``::

        {"stage": "fit", "global_step": 800, "epoch": 7,         # the weights at the end
         "checkpoint": null,                                      # validate/test: the file evaluated
         "checkpoints": {"best": ".../best-3-424.ckpt", "best_score": 95.9, "last": ".../last.ckpt"},
         "metrics": {"val/ppl": {"value": 168.4, "step": 424, "epoch": 3}}}

    A validation that ran before the end of training (e.g. ``check_val_every_n_epoch`` does not
    divide the run) is reported as such: its step differs from ``global_step``, and the summary
    says so instead of passing it off as the final weights' metrics.
    """

    def __init__(self):
        self._seen: dict[str, dict] = {}  # metric -> {"value", "step", "epoch"}
        self._checkpoint_step: tuple[int, int] | None = None

    # The step of each validation is taken when it ends, so a stale value keeps its own step.
    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self._remember(trainer, "val/")
        if trainer.state.fn == "validate":
            self._finish(trainer, "validate")

    def on_test_end(self, trainer, pl_module) -> None:
        self._remember(trainer, "test/")
        self._finish(trainer, "test")

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._checkpoint_step = (checkpoint.get("global_step", 0), checkpoint.get("epoch", 0))

    def _remember(self, trainer, prefix: str) -> None:
        step, epoch = self._weights_step(trainer)
        for key, value in trainer.callback_metrics.items():
            if key.startswith(prefix):
                self._seen[key] = {"value": float(value), "step": step, "epoch": epoch}

    def _weights_step(self, trainer) -> tuple[int, int]:
        """(global step, epoch) of the weights being evaluated: the training position in fit, the
        checkpoint's in validate/test (the trainer's counters are not restored there)."""
        if trainer.state.fn == "fit" or self._checkpoint_step is None:
            return trainer.global_step, trainer.current_epoch
        return self._checkpoint_step

    def on_fit_end(self, trainer, pl_module) -> None:
        self._finish(trainer, "fit")

    def _finish(self, trainer, stage: str) -> None:
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank must ask, not only rank 0
        if trainer.is_global_zero:
            self._report(trainer, stage, log_dir)

    def _report(self, trainer, stage: str, log_dir: str | None) -> None:
        step, epoch = self._weights_step(trainer)
        record = {
            "stage": stage,
            "global_step": step,
            "epoch": epoch,
            "checkpoint": None if stage == "fit" else trainer.ckpt_path,
            "metrics": dict(sorted(self._seen.items())),
        }
        if stage == "fit":
            record["checkpoints"] = checkpoint_files(trainer)
        print(summary(record), flush=True)
        if log_dir is not None:
            write_json(Path(log_dir) / FILE_NAME, record)


def checkpoint_files(trainer) -> dict:
    """``best`` (with ``best_score``, by the monitored ModelCheckpoint) and ``last`` checkpoint files."""
    files: dict = {}
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback.monitor and callback.best_model_path:
            files["best"] = str(Path(callback.best_model_path).resolve())
            files["best_score"] = float(callback.best_model_score) if callback.best_model_score is not None else None
        last = callback.last_model_path
        if not last and callback.save_last and callback.dirpath:
            # a run resumed at its end saves nothing, and Lightning forgets last_model_path when the
            # run folder was moved: the file is still there
            last = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
            last = str(last) if last.is_file() else None
        if last:
            files["last"] = str(Path(last).resolve())
    return files


def summary(record: dict) -> str:
    """The printed form of a record: every value with the step it comes from."""
    stage, step = record["stage"], record["global_step"]
    kind = "test" if stage == "test" else "validation"
    if not record["metrics"]:
        return f"Final {kind} metrics: none were logged (step {step})."
    where = (
        f"training ended at step {step}, epoch {record['epoch']}"
        if stage == "fit"
        else f"checkpoint {record['checkpoint']} at step {step}"
    )
    lines = [f"Final {kind} metrics ({where}):"]
    for key, entry in record["metrics"].items():
        stale = "" if entry["step"] == step else "   <- not the final weights"
        lines.append(f"  {key:<16} {entry['value']:.4f}   from step {entry['step']} (epoch {entry['epoch']}){stale}")
    if any(entry["step"] != step for entry in record["metrics"].values()):
        lines.append(
            f"  The last validation ran before the final step {step}; "
            "`mmlight validate --ckpt_path <last.ckpt>` evaluates the final weights."
        )
    return "\n".join(lines)


def write_json(path: Path, record: dict) -> None:
    """Write atomically (temporary file, then rename), so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
