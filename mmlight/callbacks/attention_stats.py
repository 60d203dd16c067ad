"""Attention statistics during training: every k validation epochs, on a fixed set of validation samples."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from mmlight.analysis.batches import batch_size, map_batch
from mmlight.analysis.massive import MassiveSettings, massive_activations, massive_rows
from mmlight.analysis.stats import Recording, Settings, metric_rows, record_statistics

log = logging.getLogger(__name__)


class AttentionStats(L.Callback):
    """Records the statistics of :mod:`mmlight.analysis.stats` on the first ``num_samples`` samples
    that global rank 0 validates (the first of the split in a single-process run; the same samples
    every time), every ``every_n_epochs`` validation epochs, starting with the first.

    Logs per-layer scalars ``attention/<site>/<metric>`` (and ``attention/<block>/token_similarity``)
    to every logger, plus, to TensorBoard, the weight histograms and their CDF (one line per layer)
    and the token similarity against depth with one line per recorded epoch (the paper's Figures 5,
    8 and 4).

    The training loop waits only for the observed forward pass: reducing the recorded attention to
    statistics (up to ``keep_mib`` of it) and drawing the figures happen on one background thread,
    while training goes on. Their results are logged at the step of their recording as soon as they
    are ready, and at the latest when the run ends, which waits for them.

    Its cost is logged: ``attention/seconds`` per recording (what the loop waited), ``attention/
    reduce_seconds`` and ``attention/figure_seconds`` (the background thread's work),
    ``attention/final_wait_seconds`` (what the end of the run waited for it), and the validation
    loop's own ``attention/validation_seconds`` at every validation epoch. Only global rank 0 does
    any of this, on the task's inner model (no collective calls, so other ranks just wait at their
    next synchronisation). Without this callback nothing is observed and attention keeps its fused
    paths.

    With ``massive_activations`` on, each recording also runs the same samples once more with forward
    hooks on the blocks (:mod:`mmlight.analysis.massive`) and logs per block ``massive/<block>/median``,
    ``massive/<block>/top1`` (means over samples), ``massive/<block>/ratio`` and ``massive/<block>/massive``,
    what the loop waited for it as ``massive/seconds``, and, where figures are drawn at every recording,
    the ``massive/activations`` figure. It is off by default: the extra forward pass waits on the loop.

    Args:
        every_n_epochs: record at validation epochs 0, k, 2k, ... (sanity checks never count).
        num_samples: how many validation samples (taken from the first validation batches).
        figures: when to draw the figures: ``every`` recording (the default; off the training loop's
            path), only at the ``end`` of fit (from the last recording and every recorded epoch's
            similarity), or ``off``.
        settings: the thresholds; :class:`~mmlight.analysis.stats.Settings` by default.
        keep_mib: how much recorded attention (MiB, on the model's device) may wait for the
            background thread; past it, the recording reduces on the loop (0: all on the loop).
        massive_activations: also record the massive activations of the blocks' outputs.
        massive_settings: their thresholds; :class:`~mmlight.analysis.massive.MassiveSettings` by default.
    """

    def __init__(
        self,
        every_n_epochs: int = 10,
        num_samples: int = 32,
        figures: Literal["every", "end", "off"] = "every",
        settings: Settings | None = None,
        keep_mib: int = 256,
        massive_activations: bool = False,
        massive_settings: MassiveSettings | None = None,
    ):
        if every_n_epochs < 1 or num_samples < 1:
            raise ValueError(f"every_n_epochs and num_samples must be >= 1, got {every_n_epochs}, {num_samples}")
        if figures not in ("every", "end", "off"):
            raise ValueError(f"figures must be 'every', 'end' or 'off', got {figures!r}")
        if keep_mib < 0:
            raise ValueError(f"keep_mib must be >= 0, got {keep_mib}")
        self.every_n_epochs, self.num_samples, self.figures = every_n_epochs, num_samples, figures
        self.keep_bytes = keep_mib * 2**20
        self.settings = settings or Settings()
        self.massive = (massive_settings or MassiveSettings()) if massive_activations else None
        self.batches: list = []
        self.validations = 0
        self.similarity_history: dict[str, dict] = {}
        self.last: dict | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int, Future]] = []  # (step, future of finish()'s result), in order

    def _collecting(self, trainer) -> bool:
        return trainer.is_global_zero and not trainer.sanity_checking

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        have = sum(batch_size(b) for b in self.batches)
        if self._collecting(trainer) and have < self.num_samples:
            take = min(batch_size(batch), self.num_samples - have)
            self.batches.append(map_batch(batch, lambda t: t[:take].detach().cpu()))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        due = self.validations % self.every_n_epochs == 0
        self.validations += 1
        if not trainer.is_global_zero:
            return
        start = time.perf_counter()
        self._log(trainer, {"attention/validation_seconds": start - self._validation_start})
        self._log_finished(trainer, wait=False)
        if not (due and self.batches):
            return
        recording = record_statistics(pl_module, self.batches, self.settings, keep_bytes=self.keep_bytes)
        label = f"epoch {trainer.current_epoch}"
        self.similarity_history[label] = {"blocks": recording.blocks}
        history = {name: dict(entry) for name, entry in self.similarity_history.items()}
        draw = self.figures == "every" and _has_tensorboard(trainer)
        self._submit(trainer, finish_recording, recording, label, history if draw else None)
        self._log(trainer, {"attention/seconds": time.perf_counter() - start})
        if self.massive is not None:
            self._record_massive(trainer, pl_module, label, draw)

    def _record_massive(self, trainer, pl_module, label: str, draw: bool) -> None:
        """Massive activations of the kept samples, logged now; the figure drawn on the background thread."""
        start = time.perf_counter()
        result = massive_activations(pl_module, self.batches, self.massive)
        scalars = {
            f"massive/{block}/{metric}": value
            for block, metric, value in massive_rows(result)
            if metric in ("median", "top1", "ratio", "massive") and value is not None
        }
        scalars["massive/seconds"] = time.perf_counter() - start
        self._log(trainer, scalars)
        if draw:
            self._submit(trainer, draw_massive, result, label)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self._log_finished(trainer, wait=False)

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and self.figures == "end" and _has_tensorboard(trainer):
            self._log_finished(trainer, wait=True)  # the last recording's statistics
            if self.last is not None:
                self._submit(trainer, redraw, self.last, self.similarity_history)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._worker is None:
            return
        start = time.perf_counter()
        self._log_finished(trainer, wait=True)
        self._log(trainer, {"attention/final_wait_seconds": time.perf_counter() - start})
        self._worker.shutdown()
        self._worker = None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self._worker is not None:  # the statistics of a failed run are not worth waiting for
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker, self._pending = None, []

    @staticmethod
    def _log(trainer, scalars: dict, step: int | None = None) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=trainer.global_step if step is None else step)

    def _submit(self, trainer, job, *args) -> None:
        """Run ``job(*args)`` on the background thread; its result is logged at the current step."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attention-stats")
        self._pending.append((trainer.global_step, self._worker.submit(job, *args)))

    def _log_finished(self, trainer, wait: bool) -> None:
        """Log the background thread's finished results (all of them, waiting, if ``wait``), in order."""
        boards = [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        while self._pending and (wait or self._pending[0][1].done()):
            step, future = self._pending.pop(0)
            done = future.result()
            if done.get("stats") is not None:
                self.last = {"label": done["label"], "stats": done["stats"]}
            self._log(trainer, done["scalars"], step=step)
            for tag, image in done["images"].items():
                for board in boards:
                    board.add_image(tag, image, global_step=step, dataformats="HWC")

    def state_dict(self) -> dict:
        return {"validations": self.validations, "similarity_history": self.similarity_history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.validations = state_dict.get("validations", 0)
        history = state_dict.get("similarity_history", {})
        self.similarity_history = {label: entry for label, entry in history.items() if _has_depths(entry)}
        dropped = len(history) - len(self.similarity_history)
        if dropped:
            log.warning(
                "AttentionStats: %d recorded epoch(s) of the checkpoint name no stack and layer per block "
                "(written by an older mmlight); the token-similarity figure leaves them out",
                dropped,
            )


def _has_depths(entry: dict) -> bool:
    """Whether a recorded epoch's blocks carry their stack and layer (what the similarity figure plots)."""
    return all("stack" in block and "layer" in block for block in entry.get("blocks", {}).values())


def _has_tensorboard(trainer) -> bool:
    return any(isinstance(lg, TensorBoardLogger) for lg in trainer.loggers)


def finish_recording(recording: Recording, label: str, similarity_history: dict | None) -> dict:
    """Reduce a recording (on the background thread) to its per-layer scalars, and draw its figures
    when ``similarity_history`` (every recorded epoch's, this one included) is given."""
    start = time.perf_counter()
    stats = recording.finish()
    scalars = {
        f"attention/{layer}/{metric}": value
        for layer, head, metric, value in metric_rows(stats)
        if head is None and value is not None
    }
    scalars["attention/reduce_seconds"] = time.perf_counter() - start
    done = {"label": label, "stats": stats, "scalars": scalars, "images": {}}
    if similarity_history is not None:
        done["images"], scalars["attention/figure_seconds"] = draw_figures(stats, similarity_history)
    return done


def draw_massive(result: dict, label: str) -> dict:
    """The massive-activations figure of one recording, as an image for TensorBoard."""
    from mmlight.analysis import figures

    start = time.perf_counter()
    image = figures.to_image(figures.massive_figure({label: result}))
    return {
        "label": label,
        "stats": None,
        "scalars": {"massive/figure_seconds": time.perf_counter() - start},
        "images": {"massive/activations": image},
    }


def redraw(last: dict, similarity_history: dict) -> dict:
    """The figures of the last recording, drawn again with every recorded epoch's similarity."""
    images, seconds = draw_figures(last["stats"], similarity_history)
    return {"label": last["label"], "stats": None, "scalars": {"attention/figure_seconds": seconds}, "images": images}


def draw_figures(stats: dict, similarity_history: dict[str, dict]) -> tuple[dict, float]:
    """The callback's three figures as images, and the seconds it took to draw them.

    Args:
        stats: one recording (:func:`~mmlight.analysis.stats.collect_statistics`).
        similarity_history: ``{epoch label: {"blocks": ...}}`` of every recording so far.
    """
    from mmlight.analysis import figures

    start = time.perf_counter()
    images = {
        "attention/weight_histogram": figures.to_image(figures.layers_figure(stats)),
        "attention/weight_cdf": figures.to_image(figures.layers_figure(stats, cdf=True)),
        "attention/token_similarity": figures.to_image(figures.similarity_figure(similarity_history)),
    }
    return images, time.perf_counter() - start
