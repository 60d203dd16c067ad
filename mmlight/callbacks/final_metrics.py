"""Print the final validation metrics when ``fit`` ends."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_only


class FinalMetrics(L.Callback):
    """At the end of ``fit``, prints every logged ``val/*`` metric of the last validation.

    Args:
        prefix: which logged metrics to print.
    """

    def __init__(self, prefix: str = "val/"):
        self.prefix = prefix

    @rank_zero_only
    def on_fit_end(self, trainer, pl_module) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(self.prefix)}
        if not metrics:
            return
        lines = [f"  {k:<16} {v:.4f}" for k, v in sorted(metrics.items())]
        print(f"Final validation metrics (epoch {trainer.current_epoch}, step {trainer.global_step}):")
        print("\n".join(lines), flush=True)
