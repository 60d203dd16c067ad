"""Attention statistics during training: every k validation epochs, on a fixed set of validation samples."""

from __future__ import annotations

import time
from typing import Literal

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from mmlight.analysis.stats import Settings, collect_statistics, metric_rows
from mmlight.analysis.tasks import batch_size, map_batch


class AttentionStats(L.Callback):
    """Records :func:`mmlight.analysis.stats.collect_statistics` on the first ``num_samples`` samples
    that global rank 0 validates (the first of the split in a single-process run; the same samples
    every time), every ``every_n_epochs`` validation epochs, starting with the first.

    Logs per-layer scalars ``attention/<site>/<metric>`` (and ``attention/<block>/token_similarity``)
    to every logger, plus, to TensorBoard, the weight histograms and their CDF (one line per layer)
    and the token similarity against depth with one line per recorded epoch (the paper's Figures 5,
    8 and 4). Its cost is logged: ``attention/seconds`` per recording, ``attention/figure_seconds``,
    and the validation loop's own ``attention/validation_seconds`` at every validation epoch. Only global rank 0 does any of this, on the task's inner
    model (no collective calls, so other ranks just wait at their next synchronisation). Without
    this callback nothing is observed and attention keeps its fused paths.

    Args:
        every_n_epochs: record at validation epochs 0, k, 2k, ... (sanity checks never count).
        num_samples: how many validation samples (taken from the first validation batches).
        figures: when to draw the figures: ``end`` (once, when fit ends, from the last recording and
            every recorded epoch's similarity: the cheap default), ``every`` (at each recording) or
            ``off``.
        settings: the thresholds; :class:`~mmlight.analysis.stats.Settings` by default.
    """

    def __init__(self, every_n_epochs: int = 10, num_samples: int = 32,
                 figures: Literal["end", "every", "off"] = "end",
                 settings: Settings | None = None):
        if every_n_epochs < 1 or num_samples < 1:
            raise ValueError(f"every_n_epochs and num_samples must be >= 1, got {every_n_epochs}, {num_samples}")
        if figures not in ("end", "every", "off"):
            raise ValueError(f"figures must be 'end', 'every' or 'off', got {figures!r}")
        self.every_n_epochs, self.num_samples, self.figures = every_n_epochs, num_samples, figures
        self.settings = settings or Settings()
        self.batches: list = []
        self.validations = 0
        self.similarity_history: dict[str, dict] = {}
        self.last: dict | None = None

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
        if not (due and self.batches):
            return
        stats = collect_statistics(pl_module, self.batches, self.settings)
        self.last = {"label": f"epoch {trainer.current_epoch}", "stats": stats}
        self.similarity_history[self.last["label"]] = {"blocks": stats["blocks"]}
        scalars = {f"attention/{layer}/{metric}": value for layer, head, metric, value in metric_rows(stats)
                   if head is None and value is not None}
        self._log(trainer, scalars)
        if self.figures == "every":
            self._figures(trainer)
        self._log(trainer, {"attention/seconds": time.perf_counter() - start})

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and self.figures == "end" and self.last is not None:
            self._figures(trainer)

    @staticmethod
    def _log(trainer, scalars: dict) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=trainer.global_step)

    def _figures(self, trainer) -> None:
        """The last recording's histogram and CDF and the similarity of every recorded epoch."""
        from mmlight.analysis import figures

        boards = [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not boards:
            return
        start = time.perf_counter()
        stats = self.last["stats"]
        drawn = {"attention/weight_histogram": figures.layers_figure(stats),
                 "attention/weight_cdf": figures.layers_figure(stats, cdf=True),
                 "attention/token_similarity": figures.similarity_figure(self.similarity_history)}
        for tag, fig in drawn.items():
            for board in boards:
                board.add_figure(tag, fig, global_step=trainer.global_step, close=False)
            figures.plt().close(fig)
        self._log(trainer, {"attention/figure_seconds": time.perf_counter() - start})

    def state_dict(self) -> dict:
        return {"validations": self.validations, "similarity_history": self.similarity_history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.validations = state_dict.get("validations", 0)
        self.similarity_history = state_dict.get("similarity_history", {})
