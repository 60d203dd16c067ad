"""Monitoring of the learned MultiMax modulations: parameters as scalars, curves as a figure."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from mmlight.reweighting import MultiMax


def multimax_modules(module: torch.nn.Module) -> dict[str, MultiMax]:
    """Every MultiMax in ``module``, keyed by a short name (``blocks.3`` for attention, ``output``)."""
    found = {}
    for name, m in module.named_modules():
        if isinstance(m, MultiMax):
            short = name.replace("model.vit.", "").replace(".attn.reweight", "").replace("model.", "")
            found[short] = m
    return found


class ReweightingMonitor(L.Callback):
    """Logs every MultiMax parameter per layer (``multimax/<layer>/ranges_<i>`` and ``.../ts_<i>``)
    each ``log_every_n_steps``, and after each validation epoch a figure of the learned sigma(x)
    per layer against the identity (the paper's Figure 3) to TensorBoard.

    Args:
        curve_range: the x range of the figure, in score units.
    """

    def __init__(self, curve_range: tuple[float, float] = (-6.0, 6.0)):
        self.curve_range = curve_range

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % trainer.log_every_n_steps:
            return
        scalars = {}
        for name, m in multimax_modules(pl_module).items():
            for param in ("ranges", "ts"):
                for i, value in enumerate(getattr(m, param).detach().cpu().tolist()):
                    scalars[f"multimax/{name}/{param}_{i}"] = value
        if scalars:
            pl_module.log_dict(scalars, on_step=True, on_epoch=False)

    @rank_zero_only
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        modules = multimax_modules(pl_module)
        if not modules or trainer.sanity_checking:
            return
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers:
            return
        figure = self.figure(modules)
        for lg in loggers:
            lg.experiment.add_figure("multimax/sigma_curves", figure, global_step=trainer.global_step)

    def figure(self, modules: dict[str, MultiMax]):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        x = torch.linspace(*self.curve_range, 241)
        cols = min(4, len(modules))
        rows = -(-len(modules) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 2.6 * rows), squeeze=False)
        for ax, (name, m) in zip(axes.flat, modules.items()):
            with torch.no_grad():
                y = m.modulate(x.to(m.ts.device)).cpu()
            ax.plot(x, x, "k--", lw=1, label="identity")
            ax.plot(x, y, lw=1.5, label="sigma")
            ax.set_title(name, fontsize=9)
        for ax in list(axes.flat)[len(modules):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        return fig
